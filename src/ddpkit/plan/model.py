"""An alpha-beta cost model of bucketed data-parallel training.

A message of ``n`` bytes over a link costs ``alpha + n * beta``: ``alpha`` is the fixed
per-message latency (software + wire), ``beta`` the inverse bandwidth. All-reduce
algorithms are sequences of such messages (Thakur, Rabenseifner & Gropp, "Optimization
of Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009):

* ring over ``p`` ranks: ``2(p-1)`` steps, each moving ``n/p`` bytes:
  ``2(p-1) alpha + 2(p-1)/p n beta`` - bandwidth-optimal, latency grows with ``p``;
* tree (reduce then broadcast along a pipelined binary tree, as NCCL's double binary
  tree): ``2 log2(p) alpha + 2 n beta`` - latency grows with ``log p`` only;
* hierarchical (reduce-scatter inside each node, all-reduce of ``n/G`` bytes between
  nodes, all-gather inside each node): intra-node hops on the fast link, and the slow
  inter-node link carries only ``1/G`` of the data per GPU.

Across nodes a flat ring or tree runs as ``G`` parallel rings/trees, one per NIC (what
NCCL's channels do), so the inter-node bandwidth of a flat algorithm is
``min(intra bandwidth, nics_per_node x NIC bandwidth)`` and its per-step latency is the
inter-node one.

A data-parallel step with gradient buckets (torch DDP's design): buckets are filled in
reverse parameter order during backward; a bucket's all-reduce starts when its last
gradient is ready *and* the previous bucket's all-reduce is done (one communication
stream, reduced in order). ``overlap`` in [0, 1] says how much of backward can hide
communication: 1 on GPUs (copy engines and NCCL kernels run beside compute), 0 when
communication needs the same CPU cores as compute (CPU training with one process per
core, as on this 2-core machine).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ddpkit.errors import ConfigError

ALGOS = ("ring", "tree", "hierarchical")


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``time(n) = alpha_s + n / bandwidth``."""

    name: str
    alpha_s: float  # per-message latency, seconds
    bandwidth_Bps: float  # bytes per second, one direction

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.bandwidth_Bps <= 0:
            raise ConfigError(f"link {self.name}: need alpha >= 0 and bandwidth > 0")

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_Bps


# Link parameters assumed for projections (peak figures from vendor datasheets; the
# latency is the per-hop software + wire figure NCCL-class libraries reach, an assumption).
PRESETS: dict[str, Link] = {
    # NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU = 450 GB/s each way.
    "nvlink4": Link("nvlink4", 2e-6, 450e9),
    # NVLink 3 (A100 SXM): 600 GB/s bidirectional per GPU = 300 GB/s each way.
    "nvlink3": Link("nvlink3", 2e-6, 300e9),
    # PCIe 4.0 x16: ~32 GB/s each way (GPUs without NVLink talk through the host).
    "pcie4": Link("pcie4", 5e-6, 32e9),
    # InfiniBand NDR (ConnectX-7): 400 Gb/s = 50 GB/s per NIC each way.
    "ib-ndr": Link("ib-ndr", 5e-6, 50e9),
    # InfiniBand HDR (ConnectX-6): 200 Gb/s = 25 GB/s per NIC each way.
    "ib-hdr": Link("ib-hdr", 5e-6, 25e9),
    # 100 Gb Ethernet with TCP: 12.5 GB/s, tens of microseconds per message.
    "eth-100g": Link("eth-100g", 30e-6, 12.5e9),
}


def link(name_or_link: str | Link) -> Link:
    if isinstance(name_or_link, Link):
        return name_or_link
    try:
        return PRESETS[name_or_link]
    except KeyError:
        raise ConfigError(f"unknown link {name_or_link!r}; known: {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` ranks; ``intra`` joins ranks of a node, ``inter``
    (one NIC per ``gpus_per_node / nics_per_node`` GPUs) joins nodes."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int | None = None  # default: one per GPU

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"cluster needs nodes >= 1 and gpus per node >= 1, got "
                              f"{self.nodes} x {self.gpus_per_node}")

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node

    def flat_link(self) -> Link:
        """The link a flat ring/tree over all ranks is limited by."""
        if self.nodes == 1:
            return self.intra
        bandwidth = min(self.intra.bandwidth_Bps, self.nics * self.inter.bandwidth_Bps)
        return Link(f"{self.inter.name}x{self.nics}", max(self.intra.alpha_s, self.inter.alpha_s),
                    bandwidth)


# ------------------------------------------------------------------- all-reduce
def ring_time(nbytes: float, p: int, ln: Link) -> float:
    if p == 1:
        return 0.0
    return 2 * (p - 1) * ln.alpha_s + 2 * (p - 1) / p * nbytes * ln.beta_s_per_byte


def tree_time(nbytes: float, p: int, ln: Link) -> float:
    if p == 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * ln.alpha_s + 2 * nbytes * ln.beta_s_per_byte


def allreduce_time(nbytes: float, cluster: Cluster, algo: str = "ring") -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` over every rank of ``cluster``."""
    p, g = cluster.ranks, cluster.gpus_per_node
    if algo == "ring":
        return ring_time(nbytes, p, cluster.flat_link())
    if algo == "tree":
        return tree_time(nbytes, p, cluster.flat_link())
    if algo == "hierarchical":
        if cluster.nodes == 1:
            return ring_time(nbytes, g, cluster.intra)
        # reduce-scatter + all-gather in the node = one intra ring all-reduce's worth
        intra = ring_time(nbytes, g, cluster.intra) if g > 1 else 0.0
        # each GPU's 1/G shard crosses nodes over its share of the NICs
        share = Link(cluster.inter.name, cluster.inter.alpha_s,
                     cluster.inter.bandwidth_Bps * cluster.nics / g)
        return intra + ring_time(nbytes / g, cluster.nodes, share)
    if algo == "best":
        return min(allreduce_time(nbytes, cluster, a) for a in ALGOS)
    raise ConfigError(f"unknown all-reduce algorithm {algo!r}; use {', '.join(ALGOS)} or best")


# ---------------------------------------------------------------------- buckets
def bucket_sizes(param_bytes: Sequence[int], cap_bytes: float,
                 first_cap_bytes: float | None = None) -> list[int]:
    """Bytes per bucket, filled in *reverse* parameter order (the order backward produces
    gradients), like torch DDP: a bucket closes once it reaches its cap. The first bucket
    has a smaller cap so communication starts early in backward."""
    if cap_bytes <= 0:
        raise ConfigError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    sizes, current = [], 0
    cap = first_cap_bytes if first_cap_bytes else cap_bytes
    for nbytes in reversed(list(param_bytes)):
        current += nbytes
        if current >= cap:
            sizes.append(current)
            current, cap = 0, cap_bytes
    if current:
        sizes.append(current)
    return sizes


# A transformer block's weight matrices in units of d^2: QKV 3, attention output 1,
# MLP in 4, MLP out 4 (biases and norms are negligible).
BLOCK_TENSORS = (3, 1, 4, 4)


def transformer_param_bytes(total_bytes: float, layers: int) -> list[int]:
    """Gradient tensor sizes of ``layers`` equal transformer blocks holding ``total_bytes``:
    bucket boundaries fall between tensors (DDP never splits one)."""
    if layers < 1:
        raise ConfigError(f"layers must be >= 1, got {layers}")
    unit = total_bytes / (layers * sum(BLOCK_TENSORS))
    sizes = [int(unit * k) for _ in range(layers) for k in BLOCK_TENSORS]
    sizes[-1] += int(total_bytes) - sum(sizes)
    return sizes


@dataclass(frozen=True)
class StepModel:
    """Compute times of one training step of one rank, in seconds."""

    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    compute_s: float
    comm_s: float  # sum of all-reduce times
    exposed_comm_s: float  # what backward did not hide
    buckets: tuple[float, ...] = field(default_factory=tuple)  # bytes per bucket

    @property
    def efficiency(self) -> float:
        """Fraction of the step spent computing: the weak-scaling efficiency."""
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0


def predict_step(step: StepModel, buckets: Sequence[float],
                 allreduce: callable, overlap: float = 1.0) -> StepPrediction:
    """Step time with buckets reduced in order on one stream during backward.

    ``allreduce(nbytes) -> seconds``. Gradients are assumed to appear at a constant rate
    in bytes through backward (true for stacks of dense layers). ``overlap`` scales how
    much of backward is available to hide communication.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ConfigError(f"overlap must be in [0, 1], got {overlap}")
    total = sum(buckets)
    comm = [allreduce(b) for b in buckets]
    # With partial overlap, backward "lends" only overlap * its time to communication:
    # model it as communication starting from the end of a shortened backward.
    hidden_window = step.backward_s * overlap
    start_of_window = step.forward_s + step.backward_s - hidden_window
    done, produced = 0.0, 0.0
    for nbytes, seconds in zip(buckets, comm):
        produced += nbytes
        ready = start_of_window + hidden_window * (produced / total if total else 1.0)
        done = max(done, ready) + seconds
    backward_end = step.forward_s + step.backward_s
    sync_end = max(backward_end, done)
    step_s = sync_end + step.optimizer_s
    return StepPrediction(step_s=step_s, compute_s=step.compute_s, comm_s=sum(comm),
                          exposed_comm_s=sync_end - backward_end, buckets=tuple(buckets))


def with_bandwidth_scale(ln: Link, factor: float) -> Link:
    """The same link at ``factor`` x its bandwidth (e.g. achieved / peak)."""
    return replace(ln, bandwidth_Bps=ln.bandwidth_Bps * factor)
