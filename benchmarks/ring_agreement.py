"""Ring all_reduce latency: what the agreement all-gather costs each ring call.

    .venv/bin/python benchmarks/ring_agreement.py [--nprocs 2] [--sizes 1K,64K,256K]
                                                  [--rounds 41] [--calls 20]

Two ways through ``ddpkit.comm.all_reduce(x, algo="ring")`` on the same ranks, taking
turns inside every round so background load hits them alike:

* ``allgather``  the default: the public layer all-gathers the call's signature
  (``check=True``), then runs the ring;
* ``nocheck``    ``check=False``: the ring alone, the floor the check is measured against.

The in-band alternative (a fixed-size signature header around the ring, with payloads
that fit riding in it; columns ``header``, ``hdr+ring``, option ``--rooms``) was
measured with this script's version at commit fce8793, which needs the ring of that
commit; to re-run it::

    git worktree add /tmp/ring-header fce8793 && cd /tmp/ring-header
    PYTHONPATH=src <main checkout>/.venv/bin/python benchmarks/ring_agreement.py --rooms 4K,16K

Results and the decision are in benchmarks/RESULTS.md.

A round is a barrier plus ``--calls`` back-to-back calls; its time per call is the
slowest rank's. Printed: the median over ``--rounds`` rounds, per size and variant.
Ratios are comparable within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit import comm

VARIANTS = ("allgather", "nocheck")


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper().removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def _rank(world, sizes: list[int], rounds: int, calls: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        run = {
            "allgather": lambda x=x: comm.all_reduce(x, algo="ring"),
            "nocheck": lambda x=x: comm.all_reduce(x, algo="ring", check=False),
        }
        for fn in run.values():  # warm-up: scratch buffers, gloo connections
            for _ in range(3):
                fn()
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for i in range(rounds):
            order = VARIANTS[i % 2:] + VARIANTS[:i % 2]  # rotate who goes first
            for name in order:
                dist.barrier()
                t = time.perf_counter()
                for _ in range(calls):
                    run[name]()
                mine = torch.tensor([(time.perf_counter() - t) / calls])
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's
                samples[name].append(mine.item() * 1e6)
        out[nbytes] = {v: statistics.median(s) for v, s in samples.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--sizes", default="1K,64K,256K")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    result = ddpkit.spawn(_rank, args.nprocs, args=(sizes, args.rounds, args.calls),
                          backend="gloo")[0]
    print(f"ring all_reduce, float32, {args.nprocs} ranks, gloo; median over "
          f"{args.rounds} rounds of {args.calls} calls (us per call, slowest rank)")
    print(f"{'size':>8s} {'allgather':>10s} {'nocheck':>10s} {'check costs':>12s}")
    for nbytes in sizes:
        m = result[nbytes]
        print(f"{nbytes // 1024:>6d}Ki {m['allgather']:10.0f} {m['nocheck']:10.0f} "
              f"{m['allgather'] - m['nocheck']:12.0f}")


if __name__ == "__main__":
    main()
