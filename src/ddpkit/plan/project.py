"""Projections: step time and weak-scaling efficiency of data-parallel training at scale.

Weak scaling: every GPU keeps the same batch (``tokens_per_gpu``), so compute per step is
constant and efficiency = compute / step time, the fraction of the step not spent waiting
for gradients. Compute comes from the usual transformer estimate of 6 FLOPs per parameter
per token (forward 2, backward 4; Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", section 2.1) at a given fraction of the GPU's peak (MFU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.errors import ConfigError
from ddpkit.plan.model import (
    ALGOS,
    Cluster,
    Link,
    StepModel,
    StepPrediction,
    allreduce_time,
    bucket_sizes,
    predict_step,
    transformer_param_bytes,
)


@dataclass(frozen=True)
class Workload:
    params: float = 1e9
    grad_bytes: int = 4  # fp32 gradients (DDP with autocast keeps fp32 params and grads)
    layers: int = 24  # transformer blocks: only bucket boundaries depend on them
    tokens_per_gpu: int = 16 * 1024  # e.g. 8 sequences of 2048 tokens
    peak_flops: float = 989e12  # H100 SXM dense BF16 (NVIDIA H100 datasheet)
    mfu: float = 0.4  # model FLOPs utilisation typical of well-tuned LLM training
    hbm_Bps: float = 3.35e12  # H100 SXM HBM3 (datasheet): the optimizer is memory-bound
    optimizer_bytes_per_param: int = 28  # Adam, fp32: read p, g, m, v; write p, m, v
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0

    def __post_init__(self) -> None:
        if self.params <= 0 or self.tokens_per_gpu <= 0 or not 0 < self.mfu <= 1:
            raise ConfigError("workload needs params > 0, tokens per GPU > 0, 0 < MFU <= 1")

    def step(self) -> StepModel:
        compute = 6 * self.params * self.tokens_per_gpu / (self.peak_flops * self.mfu)
        optimizer = self.params * self.optimizer_bytes_per_param / self.hbm_Bps
        return StepModel(forward_s=compute / 3, backward_s=2 * compute / 3,
                         optimizer_s=optimizer)

    def buckets(self) -> list[int]:
        grads = transformer_param_bytes(self.params * self.grad_bytes, self.layers)
        return bucket_sizes(grads, self.bucket_cap_mb * (1 << 20),
                            self.first_bucket_mb * (1 << 20))


@dataclass(frozen=True)
class Row:
    gpus: int
    nodes: int
    algo: str
    prediction: StepPrediction


def cluster_for(gpus: int, gpus_per_node: int, intra: Link, inter: Link) -> Cluster:
    if gpus <= gpus_per_node:
        return Cluster(1, gpus, intra, inter)
    if gpus % gpus_per_node:
        raise ConfigError(f"{gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes")
    return Cluster(gpus // gpus_per_node, gpus_per_node, intra, inter)


def project(workload: Workload, gpu_counts: Sequence[int], gpus_per_node: int, intra: Link,
            inter: Link, algos: Sequence[str] = ALGOS, overlap: float = 1.0) -> list[Row]:
    step, buckets = workload.step(), workload.buckets()
    rows = []
    for gpus in gpu_counts:
        cluster = cluster_for(gpus, gpus_per_node, intra, inter)
        for algo in algos:
            pred = predict_step(step, buckets,
                                lambda n, c=cluster, a=algo: allreduce_time(n, c, a), overlap)
            rows.append(Row(gpus, cluster.nodes, algo, pred))
    return rows


def powers_of_two(lo: int, hi: int) -> list[int]:
    if lo < 1 or hi < lo:
        raise ConfigError(f"GPU range {lo}:{hi}: need 1 <= MIN <= MAX")
    return [2 ** k for k in range(math.ceil(math.log2(lo)), int(math.log2(hi)) + 1)]


def format_table(rows: Sequence[Row], workload: Workload, intra: Link, inter: Link,
                 gpus_per_node: int, overlap: float) -> str:
    algos = list(dict.fromkeys(r.algo for r in rows))
    step = workload.step()
    buckets = workload.buckets()
    lines = [
        f"# ddpkit plan: {workload.params / 1e9:g} B parameters, {workload.grad_bytes}-byte "
        f"gradients = {workload.params * workload.grad_bytes / 1e9:.2f} GB in {len(buckets)} "
        f"buckets (cap {workload.bucket_cap_mb:g} MiB; a tensor is never split)",
        f"# compute per step {1e3 * step.compute_s:.1f} ms (fwd {1e3 * step.forward_s:.1f}, "
        f"bwd {1e3 * step.backward_s:.1f}, optimizer {1e3 * step.optimizer_s:.1f}) = "
        f"{workload.tokens_per_gpu} tokens/GPU at {workload.mfu:.0%} of "
        f"{workload.peak_flops / 1e12:g} TFLOP/s; overlap {overlap:g}",
        f"# links: intra-node {intra.name} {intra.bandwidth_Bps / 1e9:g} GB/s, "
        f"{intra.alpha_s * 1e6:g} us; inter-node {inter.name} {inter.bandwidth_Bps / 1e9:g} GB/s "
        f"per NIC, {inter.alpha_s * 1e6:g} us; {gpus_per_node} GPUs and NICs per node",
        "#" + " " * 13 + "|" + "".join(f" {a:^30} |" for a in algos),
        "#  GPUs nodes |" + " {:>12} {:>9} {:>7} |".format("all-reduce", "step", "eff")
        * len(algos),
    ]
    by = {(r.gpus, r.algo): r for r in rows}
    for gpus in sorted({r.gpus for r in rows}):
        nodes = by[(gpus, algos[0])].nodes
        line = f" {gpus:>6} {nodes:>5} |"
        for algo in algos:
            p = by[(gpus, algo)].prediction
            line += (f" {1e3 * p.comm_s:>10.1f}ms {1e3 * p.step_s:>7.1f}ms "
                     f"{100 * p.efficiency:>6.1f}% |")
        lines.append(line)
    lines.append("# all-reduce: sum over buckets of the gradient all-reduce; step: with "
                 "backward overlap; eff = compute / step (weak scaling)")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str, title: str,
         serial_rows: Sequence[Row] = ()) -> None:
    """Efficiency and all-reduce time against GPUs; ``serial_rows`` (the same projection
    without overlap) are drawn dashed in the efficiency panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = list(dict.fromkeys(r.algo for r in rows))
    fig, (ax_eff, ax_comm) = plt.subplots(1, 2, figsize=(11, 4.2))
    for algo in algos:
        mine = sorted((r for r in rows if r.algo == algo), key=lambda r: r.gpus)
        gpus = [r.gpus for r in mine]
        ax_eff.plot(gpus, [100 * r.prediction.efficiency for r in mine], marker="o", label=algo)
        line = ax_eff.lines[-1]
        serial = sorted((r for r in serial_rows if r.algo == algo), key=lambda r: r.gpus)
        if serial:
            ax_eff.plot([r.gpus for r in serial], [100 * r.prediction.efficiency for r in serial],
                        linestyle="--", color=line.get_color(), label=f"{algo}, no overlap")
        multi = [r for r in mine if r.gpus > 1]  # one GPU has nothing to reduce
        ax_comm.plot([r.gpus for r in multi], [1e3 * r.prediction.comm_s for r in multi],
                     marker="o", label=algo)
    for ax in (ax_eff, ax_comm):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_eff.set_ylabel("scaling efficiency (%)")
    ax_eff.set_ylim(0, 105)
    ax_comm.set_ylabel("gradient all-reduce per step (ms)")
    ax_comm.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
