"""Ring all_reduce latency: the in-band header against the agreement all-gather it replaced.

    .venv/bin/python benchmarks/ring_agreement.py [--nprocs 2] [--sizes 1K,64K,256K]
                                                  [--rounds 41] [--calls 20]
                                                  [--rooms 4K,64K]

Four ways through ``ddpkit.comm.all_reduce`` on the same ranks, taking turns inside
every round so background load hits them alike:

* ``allgather``  the ring as it was before the header: no in-band channel, so the public
  layer first all-gathers the call's signature (``check=True``), then runs the ring;
* ``header``     ``algo="ring"`` as built now: the signature travels in a fixed-size
  header around the ring; a payload that fits the header's room travels in it and the
  call ends there, a larger one runs the ring after the header. With ``--rooms``, one
  such variant per payload room (``header4K``, ...);
* ``hdr+ring``   the header without payload room used (``inline_bytes=0``): header, then
  the ring, at every size (what every call did before payloads rode in the header);
* ``nocheck``    the ring with no agreement at all (the old path with ``check=False``):
  the floor the checks are measured against.

``--rooms`` measures the header with other payload rooms than the library's
(``ring.HEADER_PAYLOAD_BYTES``), to choose it by measurement: each such variant sets the
room on every rank for its own calls only (the ranks take turns in lockstep, so every
header of a call has the same size) and puts the library's back afterwards.

A round is a barrier plus ``--calls`` back-to-back calls; its time per call is the
slowest rank's. Printed: the median over ``--rounds`` rounds, per size and variant, and
each variant's time over ``allgather``'s (ratios are comparable within one run only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit import comm
from ddpkit.comm import ring
from ddpkit.comm.ring import RingAlgorithm

BASE = ("allgather", "header", "hdr+ring", "nocheck")


class _RingWithoutHeader(RingAlgorithm):
    """The ring before its in-band agreement: without ``in_band`` the public layer keeps
    the agreement all-gather (or nothing, with check=False) and passes no signature, so
    no header is sent."""

    in_band = None


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper().removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def _rank(world, sizes: list[int], rounds: int, calls: int, rooms: list[int]) -> dict:
    torch.set_num_threads(1)
    comm.register_algorithm("ring_before", _RingWithoutHeader(), replace=True)
    comm.register_algorithm("ring_hdr_only", RingAlgorithm(inline_bytes=0), replace=True)
    library_room = ring.HEADER_PAYLOAD_BYTES

    def in_room(room: int, fn):
        def run() -> None:
            ring.HEADER_PAYLOAD_BYTES = room  # every rank, between the same two calls
            try:
                fn()
            finally:
                ring.HEADER_PAYLOAD_BYTES = library_room
        return run

    out = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        run = {
            "allgather": lambda x=x: comm.all_reduce(x, algo="ring_before"),
            "header": lambda x=x: comm.all_reduce(x, algo="ring"),
            "hdr+ring": lambda x=x: comm.all_reduce(x, algo="ring_hdr_only"),
            "nocheck": lambda x=x: comm.all_reduce(x, algo="ring_before", check=False),
        }
        for room in rooms:
            run[_room_name(room)] = in_room(
                room, lambda x=x: [comm.all_reduce(x, algo="ring") for _ in range(calls)])
        variants = list(run)
        for name in variants:  # warm-up: scratch buffers, gloo connections
            for _ in range(3):
                run[name]()
        samples: dict[str, list[float]] = {v: [] for v in variants}
        n = len(variants)
        for i in range(rounds):
            order = variants[i % n:] + variants[:i % n]  # rotate who goes first
            for name in order:
                dist.barrier()
                t = time.perf_counter()
                if name in BASE:
                    for _ in range(calls):
                        run[name]()
                else:
                    run[name]()  # a room variant makes all its calls in one go
                mine = torch.tensor([(time.perf_counter() - t) / calls])
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's
                samples[name].append(mine.item() * 1e6)
        out[nbytes] = {v: statistics.median(s) for v, s in samples.items()}
    return out


def _room_name(room: int) -> str:
    return f"header{room // 1024}K" if room % 1024 == 0 else f"header{room}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--sizes", default="1K,64K,256K")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rooms", default="",
                   help="also measure the header with these payload rooms, e.g. 4K,16K")
    args = p.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    rooms = [_parse_size(s) for s in args.rooms.split(",") if s.strip()]
    result = ddpkit.spawn(_rank, args.nprocs, args=(sizes, args.rounds, args.calls, rooms),
                          backend="gloo")[0]
    variants = [*BASE, *(_room_name(r) for r in rooms)]
    print(f"ring all_reduce, float32, {args.nprocs} ranks, gloo, header payload room "
          f"{ring.HEADER_PAYLOAD_BYTES} B; median over {args.rounds} rounds of {args.calls} "
          "calls (us per call, slowest rank); x/ag = time over allgather's")
    print(f"{'size':>8s} {'fits':>5s} " + " ".join(f"{v:>10s}" for v in variants)
          + " " + " ".join(f"{v + '/ag':>12s}" for v in variants[1:]))
    for nbytes in sizes:
        m = result[nbytes]
        fits = "yes" if nbytes <= ring.HEADER_PAYLOAD_BYTES else "no"
        print(f"{nbytes // 1024:>6d}Ki {fits:>5s} " + " ".join(f"{m[v]:10.0f}" for v in variants)
              + " " + " ".join(f"{m[v] / m['allgather']:12.2f}" for v in variants[1:]))


if __name__ == "__main__":
    main()
