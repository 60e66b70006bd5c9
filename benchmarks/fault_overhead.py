"""Per-step cost of ddpkit's fault-tolerance hooks, and checkpoint save/load time.

    .venv/bin/python benchmarks/fault_overhead.py [--nprocs 2] [--iters 2000] [--mib 64]

Runs N gloo ranks over a TCPStore (env:// rendezvous, like torchrun) and times, per
call: publishing progress, a guarded no-op block, the store barrier, the preemption
check (a 1-element all-reduce), and a plain 1-element all-reduce for reference. Then
saves and loads a checkpoint of ``--mib`` MiB. Prints a table (median and p90 in µs).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.checkpoint import Checkpointer
from ddpkit.fault import PreemptionGuard, ProgressBoard, Watchdog


def _timed(fn, iters: int) -> list[float]:
    dist.barrier()
    out = []
    for i in range(iters):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1e6)
    return out


def _bench(world, iters: int, mib: int, directory: str):
    torch.set_num_threads(1)
    board = ProgressBoard(prefix="bench")
    wd = Watchdog(60, board=board, exit_on_hang=False)
    one = torch.zeros(1)
    rows = {}
    rows["progress (store.set)"] = _timed(lambda i: wd.progress(i, "step"), iters)

    def guarded(i):
        with wd.guard(i, "noop"):
            pass

    rows["guard(no-op block)"] = _timed(guarded, iters)
    rows["store barrier"] = _timed(lambda i: wd.barrier(i, "b"), iters // 4)
    with PreemptionGuard() as guard:
        rows["should_stop (all_reduce MAX)"] = _timed(lambda i: guard.should_stop(), iters)
    rows["gloo all_reduce 1 float"] = _timed(lambda i: dist.all_reduce(one), iters)
    wd.close()

    ckpt = Checkpointer(directory, keep=1)
    state = {"w": torch.randn(mib * 2**18)}  # float32: 2**18 elements per MiB
    dist.barrier()
    t = time.perf_counter()
    ckpt.save(state, step=1)
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    ckpt.load_latest()
    load_s = time.perf_counter() - t
    summary = {}
    for name, samples in rows.items():
        samples.sort()
        summary[name] = (samples[len(samples) // 2], samples[int(len(samples) * 0.9)])
    return summary, save_s, load_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        results = ddpkit.spawn(_bench, args.nprocs, args=(args.iters, args.mib, directory),
                               rendezvous="env")
    summary, save_s, load_s = results[0]
    print(f"{args.nprocs} ranks, gloo, TCPStore; rank 0's timings, {args.iters} calls each")
    print(f"{'operation':32s} {'median us':>10s} {'p90 us':>10s}")
    for name, (median, p90) in summary.items():
        print(f"{name:32s} {median:10.1f} {p90:10.1f}")
    mb = args.mib * 2**20 / 1e6
    print(f"checkpoint save {args.mib} MiB (rank 0 write + fsync + agree): {save_s:.3f} s "
          f"({mb / save_s:.0f} MB/s)")
    print(f"checkpoint load_latest {args.mib} MiB (sha256 verify + load on every rank): "
          f"{load_s:.3f} s")


if __name__ == "__main__":
    main()
