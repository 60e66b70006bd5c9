"""Exact mode's sum formats with their collectives, at W ranks: where "gather" beats the others.

The gather format moves V·n float32 values in one all-gather and adds V rows; the int32
and float64 formats move about n values in two all-reduces and make three passes. Which
is faster depends on V·n, so exact mode picks gather by default up to
``GATHER_ELEMENTS`` elements in V rows (``ddpkit.parallel.exact.exact_sum32``). This
times a whole ``mean`` (local work and collectives, exact mode's own transport:
shared memory on one host) per format, per element count n and V, the formats
interleaved in a fresh order each repeat, median on rank 0; int32 (compiled) only from
``SMALL_SUM_ELEMENTS`` elements up, where it can be the default.

Run:  python benchmarks/exact_sum_formats.py [--world-size 2 --sizes ... --slices 2,8,12]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.launcher.worker_heap import worker_malloc_env
from ddpkit.parallel.exact.exact_sum32 import SMALL_SUM_ELEMENTS, make_mean
from ddpkit.parallel.exact.exact_transport import ExactTransport

FORMATS = ("gather", "float64", "int32")


def worker(world: ddpkit.World, opts: dict) -> list[dict]:
    torch.set_num_threads(1)
    transport = ExactTransport("auto", torch.device("cpu"), None)
    reduces = {"all_reduce_max": transport.max_, "all_reduce_sum": transport.sum_}
    collectives = {"gather": {"all_gather": transport.gather_}, "float64": reduces,
                   "int32": reduces}
    g = torch.Generator().manual_seed(world.rank)
    rows_out = []
    for v in opts["slices"]:
        rows = v // world.world_size
        for n in opts["sizes"]:
            formats = [f for f in FORMATS if f != "int32" or n >= SMALL_SUM_ELEMENTS]
            means = {f: make_mean(f, rows, n, v, extra=4, allocate=transport.allocate,
                                  device=torch.device("cpu"))
                     for f in formats}
            terms = torch.randn(rows, n, generator=g)
            out, flags = torch.empty(n), torch.ones(4)
            times: dict[str, list[float]] = {f: [] for f in formats}
            for i in range(opts["repeats"] + 3):
                for f in random.Random(i).sample(formats, len(formats)):
                    mean = means[f]
                    slots = terms
                    if f == "gather":  # the reducer copies each slice's gradients there
                        mean.rows_view.copy_(terms)
                        slots = mean.rows_view
                    dist.barrier()
                    start = time.perf_counter()
                    mean.mean(slots, out, extra_max=flags, **collectives[f])
                    if i >= 3:  # the first calls compile
                        times[f].append(time.perf_counter() - start)
            rows_out.append({"v": v, "n": n, **{f: statistics.median(t) * 1e6
                                                 for f, t in times.items()}})
            if world.rank == 0:
                cells = "".join(f"{rows_out[-1].get(f, float('nan')):12.1f}" for f in FORMATS)
                print(f"{n:9}{v:4}{v * n:10}{cells}", flush=True)
    transport.close()
    return rows_out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", default="2000,5000,10000,16384,30000,65536")
    p.add_argument("--slices", default="2,8,12")
    p.add_argument("--repeats", type=int, default=100)
    args = p.parse_args(argv)
    opts = {"sizes": [int(s) for s in args.sizes.split(",")],
            "slices": [int(s) for s in args.slices.split(",")], "repeats": args.repeats}
    os.environ.update(worker_malloc_env())
    os.environ.setdefault("DDPKIT_EXACT_SUM_THREADS", "1")
    print(f"{'n':>9}{'V':>4}{'V*n':>10}" + "".join(f"{f:>12}" for f in FORMATS)
          + f"   (median us per mean, {args.world_size} ranks, rank 0)", flush=True)
    load = os.getloadavg()[0]
    ddpkit.spawn(worker, nprocs=args.world_size, args=(opts,))
    print(f"load average before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
