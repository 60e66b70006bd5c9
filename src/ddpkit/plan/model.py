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

Inside a node whose GPUs are wired point to point rather than through a switch (the
DGX-1's NVLink hybrid cube mesh), the intra-node bandwidth depends on how many GPUs take
part (:meth:`Link.among`): an all-reduce among a few of them can drive only the links
that join those few, so two GPUs of a DGX-1 share one NVLink, not the six each GPU has.

A data-parallel step with gradient buckets (torch DDP's design): buckets are filled in
reverse parameter order during backward; a bucket's all-reduce starts when its last
gradient is ready *and* the previous bucket's all-reduce is done (one communication
stream, reduced in order), so the last bucket, ready only when backward ends, is never
hidden. ``overlap`` in [0, 1] says how much of backward can hide communication: 1 on GPUs
(NCCL kernels run beside compute), 0 when communication needs the same CPU cores as
compute (CPU training with one process per core, as on a 2-core machine).

Two costs come on top of computing and communicating:

* DDP's own work per step (:func:`ddp_overhead_s`): for every gradient tensor an
  autograd hook and the dispatch of its copy into the bucket and back, and the passes
  over the gradients' memory those copies and the 1/W scaling make. Both constants are
  measured on a process group of one, where nothing is communicated
  (``benchmarks/ddp_overhead.py``); the per-tensor cost is host time, the same on a GPU
  machine, the memory passes are paid at the device's memory bandwidth.
* Synchronisation (:func:`slowest_of`): every step waits for the slowest of the ``p``
  devices, and same-model devices differ in speed (power management, manufacturing).
  With a relative spread ``s`` of the step time between devices, the expected slowest
  of ``p`` takes ``1 + s * E[max of p standard normals]`` times the single-device step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddpkit.errors import ConfigError

ALGOS = ("ring", "tree", "hierarchical")


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``time(n) = alpha_s + n / bandwidth``."""

    name: str
    alpha_s: float  # per-message latency, seconds
    bandwidth_Bps: float  # bytes per second, one direction (per GPU, all of a node's GPUs)
    # GPUs wired to each other without a switch: how many links join GPU i and GPU j of a
    # node. None: a switch or a bus, where any group of GPUs sees the whole bandwidth.
    mesh: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.bandwidth_Bps <= 0:
            raise ConfigError(f"link {self.name}: need alpha >= 0 and bandwidth > 0")

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_Bps

    def among(self, gpus: int) -> Link:
        """The link as an all-reduce among a node's first ``gpus`` GPUs sees it (ranks
        take devices in order, so a job of g GPUs on a node uses GPUs 0..g-1).

        A ring all-reduce keeps one ring per link direction it can use: a ring enters
        and leaves every GPU once, so no more rings run at once than the least-connected
        GPU of the group has links to the others, and each ring moves at one link's
        speed. With a switch every group gets the whole bandwidth; on a mesh a small
        group gets only the links among its members: on a DGX-1, GPUs 0 and 1 share one
        NVLink (25 GB/s each way) while eight GPUs drive all six of each GPU's links.
        The bandwidth of the preset is that of the whole node; a group's is its share.
        """
        if self.mesh is None or gpus <= 1 or gpus >= len(self.mesh):
            return self
        group = min(sum(row[:gpus]) for row in self.mesh[:gpus])
        whole = min(sum(row) for row in self.mesh)
        return Link(f"{self.name}[{gpus} GPUs]", self.alpha_s,
                    self.bandwidth_Bps * group / whole)


# The DGX-1 (V100)'s hybrid cube mesh: NVLinks between GPU i and GPU j, as
# `nvidia-smi topo -m` prints it (NV1/NV2) on the machines of torch DDP's published
# benchmark (benchmarks/data/torch_ddp_v100_published.csv). Every GPU has six links;
# GPUs 0-3 and 4-7 form two fully joined quads, and GPU i is also joined to GPU i+4.
DGX1_NVLINKS = (
    (0, 1, 1, 2, 2, 0, 0, 0),
    (1, 0, 2, 1, 0, 2, 0, 0),
    (1, 2, 0, 2, 0, 0, 1, 0),
    (2, 1, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 1, 1, 2),
    (0, 2, 0, 0, 1, 0, 2, 1),
    (0, 0, 1, 0, 1, 2, 0, 2),
    (0, 0, 0, 1, 2, 1, 2, 0),
)

# Link parameters assumed for projections (peak figures from vendor datasheets; the
# latency is the per-hop software + wire figure NCCL-class libraries reach, an assumption).
PRESETS: dict[str, Link] = {
    # NVLink 2 (V100 SXM2, DGX-1): 6 links x 25 GB/s each way = 150 GB/s per GPU each way
    # (NVIDIA Tesla V100 datasheet: 300 GB/s bidirectional), when all 8 GPUs take part;
    # fewer GPUs of the mesh drive fewer links (Link.among).
    "nvlink2": Link("nvlink2", 2e-6, 150e9, DGX1_NVLINKS),
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
    # InfiniBand EDR (ConnectX-4/5, e.g. the DGX-1's four NICs): 100 Gb/s = 12.5 GB/s.
    "ib-edr": Link("ib-edr", 5e-6, 12.5e9),
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


# Spread of one step's time between devices of the same model in one job (relative
# standard deviation). Not measurable on a CPU-only machine: an assumption of the order
# Sinha et al. report ("Not All GPUs Are Created Equal", SC'22: 8% average performance
# variation between same-SKU V100s of a cluster, from power management and
# manufacturing), read as the range of a job's few devices around its median.
GPU_STEP_SPREAD = 0.025


@dataclass(frozen=True)
class Device:
    """An accelerator as the step model needs it (datasheet figures)."""

    name: str
    peak_flops: float  # dense BF16/FP16 tensor FLOP/s, for the FLOPs x MFU compute estimate
    memory_Bps: float  # memory bandwidth: the optimizer and DDP's gradient copies
    spread: float = GPU_STEP_SPREAD  # see GPU_STEP_SPREAD

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.memory_Bps <= 0 or not 0 <= self.spread < 1:
            raise ConfigError(f"device {self.name}: need peak FLOP/s > 0, memory bandwidth "
                              f"> 0 and a spread in [0, 1)")


DEVICES: dict[str, Device] = {
    # Tesla V100 SXM2 datasheet: 125 TFLOP/s tensor (FP16), 900 GB/s HBM2.
    "v100": Device("v100", 125e12, 900e9),
    # A100 SXM 80 GB datasheet: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e.
    "a100": Device("a100", 312e12, 2039e9),
    # H100 SXM datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3.
    "h100": Device("h100", 989e12, 3.35e12),
}


def device(name: str) -> Device:
    try:
        return DEVICES[name]
    except KeyError:
        raise ConfigError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None


# torch DDP's own cost per step, measured on one gloo rank where nothing is communicated
# (benchmarks/ddp_overhead.py, torch 2.13, 1 thread; figures and date in
# benchmarks/RESULTS-history.md, "Cost model"): host time per gradient tensor (its autograd hook
# and the dispatch of its copies), and the passes over the gradients' memory its copies
# and the 1/W scaling make (a read or a write of every gradient byte counts one).
DDP_PER_TENSOR_S = 18e-6
DDP_MEMORY_PASSES = 4.2


def ddp_overhead_s(tensors: int, grad_bytes: float, memory_Bps: float) -> float:
    """Seconds torch DDP adds to every step, on one device or many."""
    if tensors < 0:
        raise ConfigError(f"parameter tensors must be >= 0, got {tensors}")
    return tensors * DDP_PER_TENSOR_S + DDP_MEMORY_PASSES * grad_bytes / memory_Bps


def expected_max_normal(p: int) -> float:
    """E[max of p independent standard normal samples] (0 for p = 1), by quadrature of
    ``p x phi(x) Phi(x)^(p-1)``."""
    if p < 1:
        raise ConfigError(f"need at least one device, got {p}")
    if p == 1:
        return 0.0
    step, total = 1e-3, 0.0
    for i in range(-8000, 8001):
        x = i * step
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * p * pdf * cdf ** (p - 1) * step
    return total


def slowest_of(p: int, spread: float) -> float:
    """Expected step time of the slowest of ``p`` devices, relative to one device."""
    return 1.0 + spread * expected_max_normal(p)


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

    def intra_link(self) -> Link:
        """The intra-node link as this cluster's GPUs of a node drive it."""
        return self.intra.among(self.gpus_per_node)

    def flat_link(self) -> Link:
        """The link a flat ring/tree over all ranks is limited by."""
        if self.nodes == 1:
            return self.intra_link()
        bandwidth = min(self.intra_link().bandwidth_Bps, self.nics * self.inter.bandwidth_Bps)
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
            return ring_time(nbytes, g, cluster.intra_link())
        # reduce-scatter + all-gather in the node = one intra ring all-reduce's worth
        intra = ring_time(nbytes, g, cluster.intra_link()) if g > 1 else 0.0
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


def equal_param_bytes(total_bytes: float, tensors: int) -> list[int]:
    """``tensors`` gradient tensors of equal size holding ``total_bytes``: the layout when
    only the count is known (``--param-tensors``)."""
    if tensors < 1:
        raise ConfigError(f"parameter tensors must be >= 1, got {tensors}")
    sizes = [int(total_bytes // tensors)] * tensors
    sizes[-1] += int(total_bytes) - sum(sizes)
    return sizes


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
                 allreduce: callable, overlap: float = 1.0, *,
                 overhead_s: float = 0.0, slowdown: float = 1.0) -> StepPrediction:
    """Step time with buckets reduced in order on one stream during backward.

    ``allreduce(nbytes) -> seconds``. Gradients are assumed to appear at a constant rate
    in bytes through backward (true for stacks of dense layers). ``overlap`` scales how
    much of backward is available to hide communication. ``slowdown`` stretches forward
    and backward (the slowest of the devices sets the pace, :func:`slowest_of`);
    ``overhead_s`` (DDP's own work, :func:`ddp_overhead_s`) follows the last bucket:
    its copies out of the buckets wait for the reduced values.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ConfigError(f"overlap must be in [0, 1], got {overlap}")
    if slowdown < 1.0 or overhead_s < 0:
        raise ConfigError(f"need slowdown >= 1 and overhead >= 0, got {slowdown}, {overhead_s}")
    compute_s = step.compute_s
    step = StepModel(step.forward_s * slowdown, step.backward_s * slowdown, step.optimizer_s)
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
    step_s = sync_end + overhead_s + step.optimizer_s
    return StepPrediction(step_s=step_s, compute_s=compute_s, comm_s=sum(comm),
                          exposed_comm_s=sync_end - backward_end, buckets=tuple(buckets))
