"""Check the cost model against a real DDP step on this machine.

Two ranks train an MLP with torch's DistributedDataParallel (gloo, buckets of
``bucket_cap_mb``). In the same processes, alternating, we time

* steps under ``no_sync()``: forward, backward and optimizer with no communication -
  the compute the model takes as given;
* normal steps: what the model must predict from that compute, the bucket sizes and the
  calibrated all-reduce line;
* (unless a calibration file is given) plain all-reduces over a sweep of sizes, to which
  alpha and beta are fitted. Interleaving them with the steps means calibration and
  steps see the same machine: on a box shared with other work, load drifts between two
  separate commands by more than the model's error.

Each timed step or all-reduce starts after a barrier; its time is the slowest rank's; we
report medians. The prediction uses nothing measured in the synchronised steps.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ddpkit.plan.calibrate import Calibration
from ddpkit.plan.model import StepModel, StepPrediction, bucket_sizes, predict_step

# torch DDP's default buckets: 25 MiB, and a first (last-layer) bucket of 1 MiB so that
# communication starts early in backward - only when bucket_cap_mb is left at None; an
# explicit cap applies to every bucket (torch.nn.parallel.distributed as of
# torch_target.TORCH_CHECKED).
DEFAULT_CAP_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20


def bucket_caps(bucket_cap_mb: float | None) -> tuple[float, float]:
    """(cap, first-bucket cap) in bytes, as torch DDP applies them."""
    if bucket_cap_mb is None:
        return DEFAULT_CAP_BYTES, FIRST_BUCKET_BYTES
    cap = bucket_cap_mb * (1 << 20)
    return cap, cap


@dataclass(frozen=True)
class MlpSpec:
    widths: tuple[int, ...] = (1024, 2048, 2048, 2048, 10)
    batch_per_rank: int = 64
    bucket_cap_mb: float | None = None  # None: torch's default (25 MiB, first 1 MiB)
    steps: int = 12
    warmup: int = 3
    threads: int = 1
    nproc: int = 2
    calibration_sizes: tuple[int, ...] = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)


@dataclass(frozen=True)
class Measured:
    step_s: float  # synchronised DDP step, median of slowest-rank times
    forward_s: float  # no_sync medians
    backward_s: float
    optimizer_s: float
    param_bytes: tuple[int, ...]  # in model.parameters() order
    step_samples: tuple[float, ...]
    allreduce_points: tuple[tuple[int, float], ...] = ()  # (bytes, median seconds)


def _mlp(widths: tuple[int, ...]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure_rank(world, spec: MlpSpec) -> dict | None:
    """``ddpkit.spawn`` target: time synchronised and no_sync steps, alternating."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(spec.threads)
    torch.manual_seed(0)
    model = _mlp(spec.widths)
    ddp = DDP(model, bucket_cap_mb=spec.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(spec.batch_per_rank, spec.widths[0])
    y = torch.randint(0, spec.widths[-1], (spec.batch_per_rank,))

    def step(sync: bool) -> tuple[float, float, float]:
        dist.barrier()
        t0 = time.perf_counter()
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    buffers = [torch.zeros(n // 4) for n in spec.calibration_sizes]

    def reduce_once(buf: torch.Tensor) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        return time.perf_counter() - t0

    for _ in range(spec.warmup):
        step(True)
        step(False)
        for buf in buffers:
            reduce_once(buf)
    synced, local, reduces = [], [], []
    for _ in range(spec.steps):
        synced.append(sum(step(True)))
        local.append(step(False))
        reduces.append([reduce_once(buf) for buf in buffers])
    synced = _slowest(synced)
    per_size = [_slowest([r[i] for r in reduces]) for i in range(len(buffers))]
    fwd = _slowest([s[0] for s in local])
    bwd = _slowest([s[1] for s in local])
    upd = _slowest([s[2] for s in local])
    if world.rank != 0:
        return None
    med = statistics.median
    return asdict(Measured(
        step_s=med(synced), forward_s=med(fwd), backward_s=med(bwd), optimizer_s=med(upd),
        param_bytes=tuple(p.numel() * p.element_size() for p in model.parameters()),
        step_samples=tuple(synced),
        allreduce_points=tuple((buf.numel() * 4, med(times))
                               for buf, times in zip(buffers, per_size))))


def measure(spec: MlpSpec) -> Measured:
    from ddpkit.runtime.spawn import spawn

    return Measured(**spawn(measure_rank, spec.nproc, args=(spec,))[0])


def default_overlap(spec: MlpSpec) -> float:
    """No overlap when communication has no core of its own: gloo reduces on the CPU, so
    with every core busy computing, backward cannot hide it."""
    cores = os.cpu_count() or 1
    return 0.0 if spec.nproc * spec.threads >= cores else 1.0


def predict(measured: Measured, calibration: Calibration, spec: MlpSpec,
            overlap: float) -> StepPrediction:
    step = StepModel(measured.forward_s, measured.backward_s, measured.optimizer_s)
    buckets = bucket_sizes(measured.param_bytes, *bucket_caps(spec.bucket_cap_mb))
    return predict_step(step, buckets, calibration.predict, overlap)
