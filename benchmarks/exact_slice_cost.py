"""Exact mode's cost per slice on a small model: where a step's time goes beyond the floor.

The main job's MLP (64-128-10) at global batch ``--batch``, W ranks (gloo + shared
memory, 1 thread per rank, deterministic algorithms on for all), three variants
interleaved round by round in the same processes:

* ``default`` - ``DataParallel(model)``: one forward/backward of the local batch;
* ``exact``   - ``DataParallel(model, exact=True, slices=V)``, its default sum format;
* ``floor``   - the same V/W slices (contiguous copies) in plain torch on the bare
  module: no engine, no sum.

Each step is timed in parts (median ms per step on rank 0): ``loop`` (taking the next
slice from the slice iterator: cutting, seeding, and at its end the step's bookkeeping),
``forward`` (the model's forward and the loss, per slice, summed), ``backward`` (per
slice, summed; in exact mode it includes the end-of-backward callback, which keeps the
slice's gradients and after the last slice runs the sum), ``optimizer`` (zero_grad and
the SGD step). Exact mode's backward is also taken apart: ``keep`` (copying a slice's
gradients into its row), ``callback`` (the whole end-of-backward callback, keep and sum
included) and ``sum`` (the sum's ``mean``: local levels, the all-gather and the adding).

Run:  python benchmarks/exact_slice_cost.py [--world-size 2 --slices 8 --rounds 40]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddpkit
from ddpkit.launcher.worker_heap import worker_malloc_env
from ddpkit.parallel.exact.exact_gather import ExactMeanGather
from ddpkit.parallel.exact.exact_reducer import ExactReducer
from ddpkit.parallel.exact.exact_sum import ExactMean
from ddpkit.parallel.exact.exact_sum32 import ExactMean32
from ddpkit.parallel.exact.kept_grads import KeptGradients
from ddpkit.train.models import MLP

_clock = time.perf_counter
_spent: dict[str, float] = collections.defaultdict(float)  # part -> seconds, this step


def _time_method(cls, name: str, part: str) -> None:
    """Add the seconds ``cls.name`` takes to ``_spent[part]`` (benchmark only)."""
    inner = getattr(cls, name)

    def timed(*args, **kwargs):
        start = _clock()
        try:
            return inner(*args, **kwargs)
        finally:
            _spent[part] += _clock() - start

    setattr(cls, name, timed)


def _floor_loop(per_rank: int):
    def loop(*tensors):
        for m in range(per_rank):
            yield tuple(t[m::per_rank].contiguous() for t in tensors)

    return loop


def _step(model, loop, opt, x, y) -> None:
    start = _clock()
    opt.zero_grad()
    _spent["optimizer"] += _clock() - start
    if loop is None:
        t = _clock()
        loss = F.cross_entropy(model(x), y)
        t2 = _clock()
        loss.backward()
        _spent["forward"] += t2 - t
        _spent["backward"] += _clock() - t2
    else:
        slices = loop(x, y)
        while True:
            t = _clock()
            try:
                xs, ys = next(slices)
            except StopIteration:
                _spent["loop"] += _clock() - t
                break
            t2 = _clock()
            loss = F.cross_entropy(model(xs), ys)
            t3 = _clock()
            loss.backward()
            _spent["loop"] += t2 - t
            _spent["forward"] += t3 - t2
            _spent["backward"] += _clock() - t3
    t = _clock()
    opt.step()
    _spent["optimizer"] += _clock() - t
    _spent["total"] += _clock() - start


def worker(world: ddpkit.World, opts: dict) -> dict:
    torch.set_num_threads(1)
    _time_method(KeptGradients, "keep", "keep")
    _time_method(ExactReducer, "_end_of_backward", "callback")
    for mean in (ExactMeanGather, ExactMean, ExactMean32):
        _time_method(mean, "mean", "sum")
    w, v = world.world_size, opts["slices"]
    torch.manual_seed(0)
    base = MLP(64, 10, (128,))
    models = {"default": ddpkit.DataParallel(copy.deepcopy(base)),
              "exact": ddpkit.DataParallel(copy.deepcopy(base), exact=True, slices=v),
              "floor": copy.deepcopy(base)}
    loops = {"default": None, "exact": models["exact"].slices,
             "floor": _floor_loop(v // w)}
    opts_ = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    torch.use_deterministic_algorithms(True, warn_only=True)
    parts: dict[str, dict[str, list[float]]] = {k: collections.defaultdict(list)
                                                for k in models}
    local = opts["batch"] // w
    for round_index in range(opts["rounds"]):
        g = torch.Generator().manual_seed(1000 * round_index + 1 + world.rank)
        x, y = torch.randn(local, 64, generator=g), torch.randint(0, 10, (local,), generator=g)
        for name, model in models.items():
            for _ in range(opts["steps"]):
                dist.barrier()
                _spent.clear()
                _step(model, loops[name], opts_[name], x, y)
                if round_index > 0:  # the first round warms up
                    for part in ("loop", "forward", "backward", "optimizer", "total", "keep",
                                 "callback", "sum"):
                        parts[name][part].append(_spent.get(part, 0.0))
    return {name: {part: statistics.median(v) * 1e3 for part, v in p.items() if any(v)}
            for name, p in parts.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--slices", type=int, default=8)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    os.environ.update(worker_malloc_env())  # the heap setting `ddpkit launch` gives
    before = os.getloadavg()
    results = ddpkit.spawn(worker, nprocs=args.world_size,
                           args=({"slices": args.slices, "batch": args.batch,
                                  "rounds": args.rounds, "steps": args.steps},))
    after = os.getloadavg()
    order = ("total", "loop", "forward", "backward", "optimizer", "callback", "keep", "sum")
    print(f"main job's MLP, global batch {args.batch}, W = {args.world_size}, V = "
          f"{args.slices}: median ms per step on rank 0")
    print(f"{'variant':10}" + "".join(f"{k:>11}" for k in order))
    for name, r in results[0].items():
        print(f"{name:10}" + "".join(f"{r[k]:11.3f}" if k in r else f"{'':>11}" for k in order))
    print(f"load average before {before[0]:.2f}, after {after[0]:.2f} ({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
