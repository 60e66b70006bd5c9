"""Ring all_reduce latency: the in-band header against the agreement all-gather it replaced.

    .venv/bin/python benchmarks/ring_agreement.py [--nprocs 2] [--sizes 1K,64K]
                                                  [--rounds 41] [--calls 20]

Three ways through ``ddpkit.comm.all_reduce`` on the same ranks, taking turns inside
every round so background load hits them alike:

* ``allgather``  the ring as it was before: no in-band channel, so the public layer
  first all-gathers the call's signature (``check=True``), then runs the ring;
* ``header``     ``algo="ring"`` as built now: the signature travels as a fixed-size
  header around the ring, then the payload;
* ``nocheck``    the ring with no agreement at all (the old path with ``check=False``):
  the floor both checks are measured against.

A round is a barrier plus ``--calls`` back-to-back calls; its time per call is the
slowest rank's. Printed: the median over ``--rounds`` rounds, per size and variant, and
each check's cost over ``nocheck``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit import comm
from ddpkit.comm.ring import RingAlgorithm

VARIANTS = ("allgather", "header", "nocheck")


class _RingWithoutHeader(RingAlgorithm):
    """The ring before its in-band agreement: without ``in_band`` the public layer keeps
    the agreement all-gather (or nothing, with check=False) and passes no signature, so
    no header is sent."""

    in_band = None


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper().removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def _rank(world, sizes: list[int], rounds: int, calls: int) -> dict:
    torch.set_num_threads(1)
    comm.register_algorithm("ring_before", _RingWithoutHeader(), replace=True)
    out = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        run = {
            "allgather": lambda x=x: comm.all_reduce(x, algo="ring_before"),
            "header": lambda x=x: comm.all_reduce(x, algo="ring"),
            "nocheck": lambda x=x: comm.all_reduce(x, algo="ring_before", check=False),
        }
        for fn in run.values():  # warm-up: scratch buffers, gloo connections
            for _ in range(3):
                fn()
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for i in range(rounds):
            order = VARIANTS[i % 3:] + VARIANTS[:i % 3]  # rotate who goes first
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
    p.add_argument("--sizes", default="1K,64K")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    result = ddpkit.spawn(_rank, args.nprocs, args=(sizes, args.rounds, args.calls),
                          backend="gloo")[0]
    print(f"ring all_reduce, float32, {args.nprocs} ranks, gloo; median over "
          f"{args.rounds} rounds of {args.calls} calls (us per call, slowest rank)")
    print(f"{'size':>8s} {'allgather':>10s} {'header':>10s} {'nocheck':>10s} "
          f"{'all-gather costs':>17s} {'header costs':>13s} {'header/allgather':>17s}")
    for nbytes in sizes:
        m = result[nbytes]
        print(f"{nbytes // 1024:>6d}Ki {m['allgather']:10.0f} {m['header']:10.0f} "
              f"{m['nocheck']:10.0f} {m['allgather'] - m['nocheck']:17.0f} "
              f"{m['header'] - m['nocheck']:13.0f} {m['header'] / m['allgather']:17.2f}")


if __name__ == "__main__":
    main()
