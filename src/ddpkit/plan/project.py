"""Projections: step time and weak-scaling efficiency of data-parallel training at scale.

Weak scaling: every GPU keeps the same batch, so compute per step is constant and
efficiency = single-device compute / step time, the fraction of the step not spent on
DDP's own work, on waiting for gradients or for the slowest device. Compute is either
the user's measured single-device step (``step_s``: a step of the plain model, no DDP,
on one device) or the usual transformer estimate of 6 FLOPs per parameter per token
(forward 2, backward 4; Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
section 2.1) at a given fraction of the GPU's peak (MFU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.errors import ConfigError
from ddpkit.plan.model import (
    ALGOS,
    DEVICES,
    Cluster,
    Device,
    Link,
    StepModel,
    StepPrediction,
    allreduce_time,
    bucket_sizes,
    ddp_overhead_s,
    equal_param_bytes,
    predict_step,
    slowest_of,
    transformer_param_bytes,
)


@dataclass(frozen=True)
class Workload:
    params: float = 1e9
    grad_bytes: int = 4  # fp32 gradients (DDP with autocast keeps fp32 params and grads)
    layers: int = 24  # transformer blocks: the bucket layout when param_tensors is None
    tokens_per_gpu: int = 16 * 1024  # e.g. 8 sequences of 2048 tokens
    device: Device = DEVICES["h100"]
    peak_flops: float | None = None  # None: the device's
    mfu: float = 0.4  # model FLOPs utilisation typical of well-tuned LLM training
    step_s: float | None = None  # measured single-device step without DDP: replaces FLOPs
    param_tensors: int | None = None  # None: 4 weight matrices per transformer block
    optimizer_bytes_per_param: int = 28  # Adam, fp32: read p, g, m, v; write p, m, v
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0

    def __post_init__(self) -> None:
        if self.params <= 0 or self.tokens_per_gpu <= 0 or not 0 < self.mfu <= 1:
            raise ConfigError("workload needs params > 0, tokens per GPU > 0, 0 < MFU <= 1")
        if self.step_s is not None and not self.step_s > 0:
            raise ConfigError(f"the measured step must be > 0 s, got {self.step_s}")

    @property
    def tensors(self) -> int:
        return self.param_tensors if self.param_tensors else 4 * self.layers

    @property
    def gradient_bytes(self) -> float:
        return self.params * self.grad_bytes

    def step(self) -> StepModel:
        if self.step_s is not None:
            # Backward takes about twice forward (two products per forward one); the
            # optimizer, inside the measured step, counts with forward: only backward's
            # length matters to what communication can hide.
            return StepModel(forward_s=self.step_s / 3, backward_s=2 * self.step_s / 3)
        peak = self.peak_flops or self.device.peak_flops
        compute = 6 * self.params * self.tokens_per_gpu / (peak * self.mfu)
        optimizer = self.params * self.optimizer_bytes_per_param / self.device.memory_Bps
        return StepModel(forward_s=compute / 3, backward_s=2 * compute / 3,
                         optimizer_s=optimizer)

    def overhead_s(self) -> float:
        """DDP's own work per step (hooks, bucket copies), on any number of devices."""
        return ddp_overhead_s(self.tensors, self.gradient_bytes, self.device.memory_Bps)

    def buckets(self) -> list[int]:
        if self.param_tensors:
            grads = equal_param_bytes(self.gradient_bytes, self.param_tensors)
        else:
            grads = transformer_param_bytes(self.gradient_bytes, self.layers)
        return bucket_sizes(grads, self.bucket_cap_mb * (1 << 20),
                            self.first_bucket_mb * (1 << 20))


@dataclass(frozen=True)
class Row:
    gpus: int
    nodes: int
    algo: str
    prediction: StepPrediction


def cluster_for(gpus: int, gpus_per_node: int, intra: Link, inter: Link,
                nics_per_node: int | None = None) -> Cluster:
    if gpus <= gpus_per_node:
        return Cluster(1, gpus, intra, inter, nics_per_node)
    if gpus % gpus_per_node:
        raise ConfigError(f"{gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes")
    return Cluster(gpus // gpus_per_node, gpus_per_node, intra, inter, nics_per_node)


def project(workload: Workload, gpu_counts: Sequence[int], gpus_per_node: int, intra: Link,
            inter: Link, algos: Sequence[str] = ALGOS, overlap: float = 1.0,
            nics_per_node: int | None = None) -> list[Row]:
    step, buckets, overhead = workload.step(), workload.buckets(), workload.overhead_s()
    rows = []
    for gpus in gpu_counts:
        cluster = cluster_for(gpus, gpus_per_node, intra, inter, nics_per_node)
        slowdown = slowest_of(gpus, workload.device.spread)
        for algo in algos:
            pred = predict_step(step, buckets,
                                lambda n, c=cluster, a=algo: allreduce_time(n, c, a), overlap,
                                overhead_s=overhead, slowdown=slowdown)
            rows.append(Row(gpus, cluster.nodes, algo, pred))
    return rows


def best(rows: Sequence[Row]) -> dict[int, Row]:
    """The fastest algorithm's row per GPU count: the model's prediction."""
    chosen: dict[int, Row] = {}
    for r in rows:
        if r.gpus not in chosen or r.prediction.step_s < chosen[r.gpus].prediction.step_s:
            chosen[r.gpus] = r
    return chosen


def powers_of_two(lo: int, hi: int) -> list[int]:
    if lo < 1 or hi < lo:
        raise ConfigError(f"GPU range {lo}:{hi}: need 1 <= MIN <= MAX")
    return [2 ** k for k in range(math.ceil(math.log2(lo)), int(math.log2(hi)) + 1)]


def projection_table(rows: Sequence[Row], workload: Workload, intra: Link, inter: Link,
                 gpus_per_node: int, overlap: float, nics_per_node: int | None = None) -> str:
    algos = list(dict.fromkeys(r.algo for r in rows))
    step = workload.step()
    buckets = workload.buckets()
    dev = workload.device
    if workload.step_s is not None:
        source = "the measured single-device step (--step-ms)"
    else:
        peak = workload.peak_flops or dev.peak_flops
        source = (f"{workload.tokens_per_gpu} tokens/GPU at {workload.mfu:.0%} of "
                  f"{peak / 1e12:g} TFLOP/s")
    lines = [
        f"# ddpkit plan: {workload.params / 1e9:g} B parameters in {workload.tensors} tensors, "
        f"{workload.grad_bytes}-byte gradients = {workload.gradient_bytes / 1e9:.3g} GB in "
        f"{len(buckets)} buckets (cap {workload.bucket_cap_mb:g} MiB; a tensor is never split)",
        f"# compute per step {1e3 * step.compute_s:.1f} ms (fwd {1e3 * step.forward_s:.1f}, "
        f"bwd {1e3 * step.backward_s:.1f}, optimizer {1e3 * step.optimizer_s:.1f}) = "
        f"{source}; overlap {overlap:g}",
        f"# DDP's own work {1e3 * workload.overhead_s():.2f} ms per step ({dev.name}: "
        f"{dev.memory_Bps / 1e9:g} GB/s memory); slowest of p devices at a "
        f"{100 * dev.spread:g}% spread",
        f"# links: intra-node {intra.name} {intra.bandwidth_Bps / 1e9:g} GB/s"
        f"{' (all of a node; a mesh: fewer GPUs drive fewer links)' if intra.mesh else ''}, "
        f"{intra.alpha_s * 1e6:g} us; inter-node {inter.name} {inter.bandwidth_Bps / 1e9:g} GB/s "
        f"per NIC, {inter.alpha_s * 1e6:g} us; {gpus_per_node} GPUs and "
        f"{nics_per_node or gpus_per_node} NICs per node",
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
