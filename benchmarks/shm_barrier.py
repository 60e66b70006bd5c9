"""The shared-memory barrier alone, two ranks, on two cores and squeezed onto one.

    flock /work/wt/cpu.lock .venv/bin/python benchmarks/shm_barrier.py [--calls 3000]

Two forked processes share one control block (``ddpkit.comm.shm.sync.Control``) and
call ``barrier()`` back to back, with a little work between calls (a 1 KiB tensor add,
so that the two do not arrive in lock step). Placed three ways: ``apart`` (pinned to
different cores: the quiet case), ``together`` (both pinned to one core: the ranks
cannot run at the same time, as on a loaded machine), ``free`` (the scheduler's choice).
Reported per placement: rank 0's median and mean time per call over ``--calls`` calls
(the first ``--warmup`` left out). Run it with another ddpkit on ``PYTHONPATH`` to
compare barriers side by side.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import time

import torch

PLACEMENTS = ("apart", "together", "free")


def _rank(me: int, buffer, placement: str, calls: int, warmup: int, queue) -> None:
    from ddpkit.comm.shm.sync import Control

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "apart":
        os.sched_setaffinity(0, {cpus[me % len(cpus)]})
    elif placement == "together":
        os.sched_setaffinity(0, {cpus[0]})
    control = Control(buffer, 2, me, 60.0, ["rank 0", "rank 1"])
    a, b = torch.ones(256), torch.ones(256)
    times = []
    for i in range(calls + warmup):
        start = time.perf_counter()
        torch.add(a, b, out=a)
        control.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if me == 0:
        queue.put((statistics.median(times), statistics.fmean(times)))


def measure(placement: str, calls: int, warmup: int) -> tuple[float, float]:
    from ddpkit.comm.shm.sync import block_bytes

    ctx = mp.get_context("fork")
    buffer = mmap.mmap(-1, block_bytes(2))  # anonymous, shared with the forked ranks
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, buffer, placement, calls, warmup, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="runs per placement (median)")
    args = p.parse_args()
    import ddpkit

    print(f"ddpkit at {os.path.dirname(ddpkit.__file__)}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| placement | median per call (us) | mean per call (us) |")
    print("| --- | ---: | ---: |")
    for placement in PLACEMENTS:
        runs = [measure(placement, args.calls, args.warmup) for _ in range(args.rounds)]
        med = statistics.median(r[0] for r in runs)
        mean = statistics.median(r[1] for r in runs)
        print(f"| {placement} | {med * 1e6:.1f} | {mean * 1e6:.1f} |")


if __name__ == "__main__":
    main()
