"""What the framework programs beside this file record, one JSON file per rank: which
engine wrapped the model, how many torch.distributed calls ddpkit answered, step times,
and the time of a 1 KiB all_reduce called the way frameworks call it."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def mlp() -> torch.nn.Module:
    """The MLP the Accelerate and Lightning programs train (32 inputs, 4 classes)."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 4))


def engine_of(model) -> dict:
    from ddpkit.parallel.ddp import DataParallel

    return {"class": f"{type(model).__module__}.{type(model).__qualname__}",
            "is_torch_ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
            "is_ddpkit": isinstance(model, DataParallel)}


def routed_counts() -> dict:
    route = sys.modules.get("ddpkit.comm.torch_route")
    return route.counts() if route is not None else {}


def small_all_reduce_s(calls: int) -> float | None:
    """Median seconds of ``torch.distributed.all_reduce`` on 256 float32 (1 KiB)."""
    tensor = torch.ones(256)
    return _median_s(calls, lambda: dist.all_reduce(tensor))


def one_number_all_gather_s(calls: int) -> float | None:
    """Median seconds of ``torch.distributed.all_gather`` of one int64 per rank (what the
    Trainer does with the batch's token count every step)."""
    mine = torch.ones(1, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    return _median_s(calls, lambda: dist.all_gather(out, mine))


def _median_s(calls: int, fn) -> float | None:
    if calls <= 0:
        return None
    times = []
    for i in range(calls + 20):
        start = time.perf_counter()
        fn()
        if i >= 20:  # the first calls set up buffers
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class StepClock:
    """Seconds between consecutive optimizer steps (the first is left out)."""

    def __init__(self):
        self.last = None
        self.times: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def write(out: str, record: dict) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({**record, "rank": rank, "routed": routed_counts()}, fh)
