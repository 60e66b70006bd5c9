"""The distributed tutorial's ring all-reduce, then the segmented one it leaves as an exercise.

Run:  ddpkit launch --nproc-per-node 2 examples/10_ring_allreduce.py [--mib 16]

The tutorial's ring passes the *whole* tensor around: P-1 hops of N bytes each, one
blocking receive at a time. ddpkit.comm's ring splits the tensor into P chunks
(reduce-scatter, then all-gather: each rank moves only 2(P-1)/P of N), cuts each
chunk into segments, and keeps receives posted ahead so the wire, the socket thread
and the additions overlap. Both results are checked against torch's all_reduce.
"""

import argparse
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit import comm


def tutorial_allreduce(send: torch.Tensor, recv: torch.Tensor) -> None:
    """The tutorial's version: every rank ends with the sum of all ``send`` tensors in ``recv``."""
    rank, size = dist.get_rank(), dist.get_world_size()
    outgoing, incoming = send.clone(), send.clone()
    total = send.clone()
    right, left = (rank + 1) % size, (rank - 1) % size
    for hop in range(size - 1):
        # Alternate buffers: forward what arrived last hop while receiving the next one.
        if hop % 2 == 0:
            req = dist.isend(outgoing, right)
            dist.recv(incoming, left)
            total += incoming
        else:
            req = dist.isend(incoming, right)
            dist.recv(outgoing, left)
            total += outgoing
        req.wait()
    recv.copy_(total)


def timed(fn, repeats: int = 5) -> float:
    fn()  # warm-up: connections, allocations
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=16.0, help="tensor size in MiB")
    args = parser.parse_args(argv)
    with ddpkit.distributed() as world:
        n = int(args.mib * (1 << 20)) // 4
        data = torch.randint(-100, 100, (n,)).float() * (world.rank + 1)
        expected = data.clone()
        dist.all_reduce(expected)

        out = torch.empty_like(data)
        tutorial_allreduce(data, out)
        ours = data.clone()
        comm.all_reduce(ours, algo="ring")
        assert torch.equal(out, expected) and torch.equal(ours, expected)

        # busbw: the bandwidth each link sustains, comparable across rank counts.
        factor = 2 * (world.world_size - 1) / world.world_size
        rows = []
        for name, fn in (
            ("tutorial ring (whole tensor)", lambda: tutorial_allreduce(data, out)),
            ("ddpkit.comm ring (segmented)", lambda: comm.all_reduce(data.clone(), algo="ring")),
            ("torch / gloo all_reduce", lambda: dist.all_reduce(data.clone())),
        ):
            t = timed(fn)
            rows.append((name, t, data.numel() * 4 / t / 1e9 * factor))
        if world.rank == 0:
            print(f"all-reduce of {args.mib:g} MiB, {world.world_size} ranks: results match torch")
            for name, t, busbw in rows:
                print(f"  {name:<30} {t * 1e3:8.1f} ms   busbw {busbw:6.3f} GB/s")
            print("  (times include one tensor clone for the last two; see "
                  "`ddpkit bench collectives` for careful numbers)")


if __name__ == "__main__":
    main()
