"""A small ``torch.distributed.all_reduce`` routed through ddpkit vs the same call on gloo.

    flock /work/wt/cpu.lock .venv/bin/python benchmarks/torch_route_speed.py [--rounds 7]

Two ranks on one host (a FileStore, gloo default group). In every round each rank times
``--calls`` calls of each variant back to back, the variants taking turns round by
round, so load drift hits all alike; reported: per variant the median over rounds of
the per-round median call time (rank 0), and each variant's speed-up over gloo:

* ``gloo``: ``torch.distributed.all_reduce`` with torch's own function (not routed);
* ``routed``: the same call with ddpkit's route installed (what a program under
  ``ddpkit launch`` gets);
* ``ddpkit.comm``: ``ddpkit.comm.all_reduce(t)`` (the public call, its remembered path);
* ``direct``: the path both of those remember, called directly (the shared-memory
  communicator's small all_reduce bound to the op and dtype);
* ``engine``: the communicator's generic ``all_reduce`` called directly;
* ``barrier``: one barrier of the communicator, what every call above waits for.

``direct`` and ``barrier`` need this branch's ddpkit (comm/shm/direct.py); run with an
older ddpkit they are left out.

Sizes default to 1 KiB (256 float32, the issue's figure) and 64 B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("gloo", "routed", "ddpkit.comm", "direct", "engine", "barrier")


def _timed(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, store_path: str, args, out_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    from ddpkit import comm
    from ddpkit.comm import torch_route
    from ddpkit.comm.shm.algorithm import group_communicator
    try:
        from ddpkit.comm.shm.direct import DirectAllReduce
    except ImportError:  # an older ddpkit, for a before/after comparison
        DirectAllReduce = None

    results: dict = {}
    try:
        engine = group_communicator(None)
        for numel in args.numel:
            tensor = torch.ones(numel)
            original = torch_route.original("all_reduce")

            def gloo(t=tensor, fn=original):
                fn(t)

            def routed(t=tensor):
                dist.all_reduce(t)

            def public(t=tensor):
                comm.all_reduce(t)

            def generic(t=tensor):
                engine.all_reduce(t, "sum")

            fns = {"gloo": gloo, "routed": routed, "ddpkit.comm": public, "engine": generic,
                   "barrier": engine.control.barrier}
            if DirectAllReduce is not None:
                bound = DirectAllReduce(engine, "sum", tensor.dtype, engine._code(
                    "all_reduce", "sum", tensor.dtype)[1])
                fns["direct"] = lambda t=tensor, fn=bound: fn(t)
            torch_route.route()
            for fn in fns.values():  # warm up: buffers, remembered routes
                for _ in range(20):
                    fn()
            per_round: dict = {v: [] for v in fns}
            for _ in range(args.rounds):
                for name in VARIANTS:
                    if name in fns:
                        per_round[name].append(_timed(fns[name], args.calls))
            torch_route.restore()
            results[numel] = per_round
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump({str(k): v for k, v in results.items()}, fh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=300, help="timed calls per variant per round")
    p.add_argument("--numel", type=int, nargs="+", default=[256, 16],
                   help="float32 elements (256 = 1 KiB)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        started = time.time()
        mp.spawn(_worker, args=(2, store, args, out), nprocs=2, join=True)
        with open(out) as fh:
            results = json.load(fh)
    print(f"W=2, CPU, gloo default group; {args.rounds} rounds x {args.calls} calls per "
          f"variant; {time.time() - started:.0f} s; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load average {os.getloadavg()[0]:.1f}")
    shown = [v for v in VARIANTS if v in next(iter(results.values()))]
    print("| size | " + " | ".join(f"{v} (us)" for v in shown)
          + " | routed x gloo | ddpkit.comm x gloo |")
    print("| --- |" + " ---: |" * (len(shown) + 2))
    for numel, per_round in results.items():
        med = {v: statistics.median(per_round[v]) for v in shown}
        cells = " | ".join(f"{med[v] * 1e6:.1f}" for v in shown)
        print(f"| {int(numel) * 4} B | {cells} | {med['gloo'] / med['routed']:.0f}x | "
              f"{med['gloo'] / med['ddpkit.comm']:.0f}x |")


if __name__ == "__main__":
    main()
