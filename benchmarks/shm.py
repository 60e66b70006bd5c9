"""Shared-memory all-reduce against gloo, side by side in one launch.

    .venv/bin/python benchmarks/shm.py [--nprocs 2] [--sizes 4K,64K,4M,16M] [--out DIR]

For each message size every rank times, in the same processes and interleaved:
  gloo      torch.distributed.all_reduce on a private tensor (TCP loopback)
  shm-copy  ShmCommunicator.all_reduce on a private tensor (copied through shared slots)
  shm       ShmCommunicator.all_reduce on a tensor from .allocate() (no copy in or out;
            what DataParallel's buckets get)
and reports the median time per call (the slowest rank's), bus bandwidth
(bytes * 2(W-1)/W / time, the all-reduce convention) and the ratio to gloo.
Writes shm.json and shm.csv to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.comm.shm import ShmCommunicator

ALGOS = ("gloo", "shm-copy", "shm")


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    if text[-1:] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _time_calls(call, iters: int, rounds: int) -> float:
    """Median over rounds of the mean time per call, slowest rank."""
    samples = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        samples.append((time.perf_counter() - start) / iters)
    mine = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(mine, dist.ReduceOp.MAX)
    return mine.item()


def _calls(comm: ShmCommunicator, private: torch.Tensor, shared: torch.Tensor) -> dict:
    return {
        "gloo": lambda: dist.all_reduce(private),
        "shm-copy": lambda: comm.all_reduce(private),
        "shm": lambda: comm.all_reduce(shared),
    }


def worker(world, sizes: list[int], budget_s: float) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with ShmCommunicator() as comm:
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            private = torch.randn(numel)
            shared = comm.allocate(numel, torch.float32)
            shared.copy_(private)
            calls = _calls(comm, private, shared)
            # Calibrate iterations on gloo (the slowest) so every size costs ~budget_s.
            for call in calls.values():
                call()
            probe = _time_calls(calls["gloo"], 2, 1)
            iters = int(max(3, min(2000, budget_s / 5 / max(probe, 1e-6))))
            times = {name: _time_calls(call, iters, 5) for name, call in calls.items()}
            W = world.world_size
            for name in ALGOS:
                t = times[name]
                rows.append({
                    "algo": name, "bytes": numel * 4, "world_size": W, "iters": iters,
                    "time_us": t * 1e6, "busbw_GBps": numel * 4 * 2 * (W - 1) / W / t / 1e9,
                    "speedup_vs_gloo": times["gloo"] / t,
                })
    return rows


def human(nbytes: int) -> str:
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--sizes", default="4,1K,16K,64K,256K,1M,4M,16M,32M")
    p.add_argument("--budget", type=float, default=0.6, help="seconds per size and algorithm")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = ddpkit.spawn(worker, args.nprocs, args=(sizes, args.budget))[0]
    print(f"all_reduce float32, {args.nprocs} ranks, median per call (slowest rank)")
    print(f"{'size':>6} {'algo':>9} {'time_us':>10} {'busbw GB/s':>11} {'x gloo':>7}")
    for r in rows:
        print(f"{human(r['bytes']):>6} {r['algo']:>9} {r['time_us']:>10.1f} "
              f"{r['busbw_GBps']:>11.2f} {r['speedup_vs_gloo']:>7.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "shm.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "shm.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}/shm.json and shm.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
