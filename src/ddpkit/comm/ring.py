"""Segmented ring collectives on torch.distributed point-to-point (built and tested on gloo).

All-reduce is a reduce-scatter followed by an all-gather around the ring (Baidu's
DeepSpeech ring; Patarasuk & Yuan's bandwidth-optimal schedule): with P ranks the
tensor is cut into P chunks, and in each of P-1 steps every rank sends one chunk to
its right neighbour while receiving another from its left. Each rank moves
2(P-1)/P of the tensor, which is why bus bandwidth uses that factor.

Why segments: sending a whole chunk, then waiting for it, then reducing it leaves the
wire idle while the CPU adds and the CPU idle while the wire copies. Cutting each
chunk into bounded segments and keeping a few receives posted ahead lets segment k+1
travel while segment k is being reduced (gloo's own ring does the same: <= 1 MiB
segments, two in flight). Beyond gloo's scheme, a segment is forwarded the moment it
lands, so the 2(P-1) steps run as one pipeline (see ``RingAlgorithm._ring``). Receive
buffers are preallocated per thread and reduced straight into the destination, so
the steady state allocates nothing and copies each byte once.

The schedule needs p2p messages matched in posting order per peer with non-blocking
isend/irecv (gloo, MPI). NCCL's individual p2p calls are blocking kernels; use
``algo="backend"`` there.

Every rank derives the same chunk and segment boundaries from the tensor size alone,
so a segment sent by rank r has exactly the size rank r+1 posted for it (gloo aborts
the process on a size mismatch; the caller's agreement check guards the sizes). That
check is the public layer's agreement all-gather: a fixed-size signature header sent
around the ring instead, with small payloads riding in it, was built and measured on
gloo and was not reliably cheaper (docs/collectives.md, benchmarks/RESULTS-history.md).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit.comm import ops
from ddpkit.comm.groups import GroupView, view


@dataclass(frozen=True)
class Step:
    """One ring step as seen by the receiving rank: where the incoming chunk goes."""

    out: torch.Tensor
    base: torch.Tensor | None = None  # reduce into out = base (op) received; None: out
    reduce: bool = False


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, stop) ranges covering ``range(n)``, sizes differing by <= 1."""
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


class RingAlgorithm:
    """Ring collectives with chunks cut into segments of at most ``segment_bytes``.

    ``min_segments``: at least this many segments per chunk (so even small chunks
    pipeline). ``in_flight``: receives posted ahead of the one being reduced.
    ``segment_bytes=None`` with ``min_segments=1, in_flight=1`` is the tutorial's
    unsegmented ring, kept as "naive_ring" for comparison.
    """

    def __init__(
        self,
        segment_bytes: int | None = 1 << 20,
        *,
        min_segments: int = 2,
        in_flight: int = 2,
    ):
        if segment_bytes is not None and segment_bytes < 1:
            raise ValueError(f"segment_bytes must be positive or None, got {segment_bytes}")
        if min_segments < 1 or in_flight < 1:
            raise ValueError("min_segments and in_flight must be >= 1")
        self.segment_bytes = segment_bytes
        self.min_segments = min_segments
        self.in_flight = in_flight
        self._scratch = threading.local()  # one set per thread: async lanes run beside callers

    def __repr__(self) -> str:
        return (
            f"RingAlgorithm(segment_bytes={self.segment_bytes}, "
            f"min_segments={self.min_segments}, in_flight={self.in_flight})"
        )

    # -- segment planning ------------------------------------------------------------

    def segments(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Cut a 1-D chunk into balanced segments; empty chunks have none."""
        n = chunk.numel()
        if n == 0:
            return []
        count = self.min_segments
        if self.segment_bytes is not None:
            per_segment = max(1, self.segment_bytes // chunk.element_size())
            count = max(count, -(-n // per_segment))
        count = min(count, n)
        return [chunk[a:b] for a, b in split(n, count)]

    def _buffers(self, like: torch.Tensor, numel: int, count: int) -> list[torch.Tensor]:
        """``count`` reusable receive buffers of ``numel`` elements (grown, never shrunk)."""
        key = (like.dtype, like.device, count)
        cache = self._scratch.__dict__
        bufs = cache.get(key)
        if bufs is None or bufs[0].numel() < numel:
            bufs = [torch.empty(numel, dtype=like.dtype, device=like.device) for _ in range(count)]
            cache[key] = bufs
        return [b[:numel] for b in bufs]

    # -- the pipelined ring -------------------------------------------------------------

    def _ring(
        self,
        g: GroupView,
        first_send: torch.Tensor,
        steps: list[Step],
        kern: ops.Kernel | None,
    ) -> None:
        """Run ``steps`` around the ring as one pipeline.

        Step t receives ``steps[t].out`` from the left (reducing ``out = base (op) got``
        when ``steps[t].reduce``) and sends to the right what step t-1 received
        (``first_send`` at t = 0). A segment is forwarded the moment it lands, so step
        t+1 starts while step t is still arriving: no drain between steps, and the
        all-gather overlaps the reduce-scatter's tail.

        Receives are posted in the order the left neighbour sends (step-major, then
        segment), which is all that p2p matching relies on. Receives that land in
        scratch (the reducing ones) are limited to ``in_flight`` at a time; direct ones
        are posted as soon as their turn comes, so the sender is never held up by
        this rank's Python loop.
        """
        segs = [self.segments(st.out) for st in steps]
        bases = [self.segments(st.base) if st.base is not None else seg for st, seg in
                 zip(steps, segs)]
        order = [(t, k) for t in range(len(steps)) for k in range(len(segs[t]))]
        widest = max((x.numel() for t, _ in order if steps[t].reduce for x in segs[t]),
                     default=0)
        scratch = self._buffers(first_send, widest, self.in_flight) if widest else []
        free = deque(range(len(scratch)))
        posted: deque = deque()
        sending: dict[int, object] = {}  # segment address -> its unfinished send
        sends = [dist.isend(x, g.right, group=g.group) for x in self.segments(first_send)]
        cursor = 0

        def post_ahead() -> None:
            nonlocal cursor
            while cursor < len(order):
                t, k = order[cursor]
                if steps[t].reduce:
                    if not free:
                        return
                    slot = free.popleft()
                    buf = scratch[slot][: segs[t][k].numel()]
                else:
                    slot, buf = None, segs[t][k]
                posted.append((dist.irecv(buf, g.left, group=g.group), buf, slot))
                cursor += 1

        post_ahead()
        for t, k in order:
            work, got, slot = posted.popleft()
            work.wait()
            out = segs[t][k]
            if slot is not None:
                pending = sending.pop(out.data_ptr(), None)
                if pending is not None:  # never overwrite bytes still being sent
                    pending.wait()
                kern(out, bases[t][k], got)
                free.append(slot)
            if t + 1 < len(steps):
                work = dist.isend(out, g.right, group=g.group)
                sends.append(work)
                sending[out.data_ptr()] = work
            post_ahead()
        for work in sends:
            work.wait()

    # -- collectives --------------------------------------------------------------------
    # The public layer (ddpkit.comm.collectives) hands these 1-D contiguous tensors,
    # never op "avg" (it sums and divides), and never a group of one.

    def all_reduce(self, tensor: torch.Tensor, op: str, group=None) -> None:
        g = view(group)
        p, r = g.size, g.rank
        chunks = [tensor[a:b] for a, b in split(tensor.numel(), p)]
        # Reduce-scatter: step t reduces chunk r-t-1 into place; afterwards this rank
        # holds the complete chunk r+1. All-gather: step a receives chunk r-a.
        steps = [Step(chunks[(r - t - 1) % p], reduce=True) for t in range(p - 1)]
        steps += [Step(chunks[(r - a) % p]) for a in range(p - 1)]
        self._ring(g, chunks[r], steps, ops.kernel(op))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group=None
    ) -> None:
        # The caller's input must survive, so partial sums go to staging blocks
        # (out = own block (op) received) instead of into the input; the schedule is
        # all_reduce's shifted by one so the last block reduced here is this rank's own.
        g = view(group)
        p, r = g.size, g.rank
        m = output.numel()
        blocks = [input[i * m : (i + 1) * m] for i in range(p)]
        stage = [torch.empty_like(output) for _ in range(min(2, p - 2))]
        steps = [
            Step(output if t == p - 2 else stage[t % 2], base=blocks[(r - t - 2) % p],
                 reduce=True)
            for t in range(p - 1)
        ]
        self._ring(g, blocks[(r - 1) % p], steps, ops.kernel(op))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None) -> None:
        g = view(group)
        m = input.numel()
        chunks = [output[i * m : (i + 1) * m] for i in range(g.size)]
        chunks[g.rank].copy_(input)
        steps = [Step(chunks[(g.rank - s - 1) % g.size]) for s in range(g.size - 1)]
        self._ring(g, chunks[g.rank], steps, None)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None) -> None:
        """A pipelined chain src -> src+1 -> ...: each rank forwards a segment as soon as
        it has landed, so the whole tensor takes one hop's time plus a segment per rank."""
        g = view(group)
        pos = (g.rank - g.group_rank_of(src, "src")) % g.size
        segs = self.segments(tensor)
        if pos == 0:
            sends = [dist.isend(s, g.right, group=g.group) for s in segs]
        else:
            sends = []
            forward = pos < g.size - 1
            pending: deque = deque()

            def land() -> None:
                work, got = pending.popleft()
                work.wait()
                if forward:
                    sends.append(dist.isend(got, g.right, group=g.group))

            for seg in segs:
                pending.append((dist.irecv(seg, g.left, group=g.group), seg))
                if len(pending) >= self.in_flight:
                    land()
            while pending:
                land()
        for work in sends:
            work.wait()

    def reduce(self, tensor: torch.Tensor, dst: int, op: str, group=None) -> None:
        """A pipelined chain ending at ``dst``: dst+1 sends, each next rank adds its own
        segment and forwards. Only ``dst``'s tensor changes; dst receives the tensor
        once, the least any reduce to one rank can do."""
        g = view(group)
        pos = (g.rank - g.group_rank_of(dst, "dst") - 1) % g.size  # dst is last
        segs = self.segments(tensor)
        kern = ops.kernel(op)
        if pos == 0:
            for work in [dist.isend(s, g.right, group=g.group) for s in segs]:
                work.wait()
            return
        last = pos == g.size - 1
        depth = self.in_flight
        width = max((s.numel() for s in segs), default=0)
        scratch = self._buffers(tensor, width, depth)
        # A relaying rank must not touch its own tensor, so partial sums go to staging
        # slots; a slot is reused only after the send that read it has finished.
        staging = [] if last else self._buffers(tensor, width, depth + 1)
        sends: deque = deque()
        pending: deque = deque()

        def land() -> None:
            k, work, got = pending.popleft()
            work.wait()
            seg = segs[k]
            if last:
                kern(seg, seg, got)
                return
            if len(sends) > depth:
                sends.popleft().wait()
            out = staging[k % (depth + 1)][: seg.numel()]
            kern(out, seg, got)
            sends.append(dist.isend(out, g.right, group=g.group))

        for k, seg in enumerate(segs):
            got = scratch[k % depth][: seg.numel()]
            pending.append((k, dist.irecv(got, g.left, group=g.group), got))
            if len(pending) >= depth:
                land()
        while pending:
            land()
        for work in sends:
            work.wait()
