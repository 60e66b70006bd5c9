"""Segmented ring collectives on torch.distributed point-to-point (any backend).

All-reduce is a reduce-scatter followed by an all-gather around the ring (Baidu's
DeepSpeech ring; Patarasuk & Yuan's bandwidth-optimal schedule): with P ranks the
tensor is cut into P chunks, and in each of P-1 steps every rank sends one chunk to
its right neighbour while receiving another from its left. Each rank moves
2(P-1)/P of the tensor, which is why bus bandwidth uses that factor.

Why segments: sending a whole chunk, then waiting for it, then reducing it leaves the
wire idle while the CPU adds and the CPU idle while the wire copies. Cutting each
chunk into bounded segments and keeping a few receives posted ahead lets segment k+1
travel while segment k is being reduced (gloo's own ring does the same: <= 1 MiB
segments, two in flight). Receive buffers are preallocated per thread and reduced
straight into the destination, so the steady state allocates nothing and copies each
byte once.

Every rank derives the same chunk and segment boundaries from the tensor size alone,
so a segment sent by rank r has exactly the size rank r+1 posted for it (gloo aborts
the process on a size mismatch; the caller's agreement check guards the sizes).
"""

from __future__ import annotations

import threading
from collections import deque

import torch
import torch.distributed as dist

from ddpkit.comm import ops
from ddpkit.comm.groups import GroupView, view


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

    # -- the two ring phases -----------------------------------------------------------

    def _step(
        self,
        g: GroupView,
        send: list[torch.Tensor],
        recv: list[torch.Tensor],
        reduce_with: ops.Kernel | None,
        base: list[torch.Tensor] | None = None,
    ) -> None:
        """Send ``send`` segments right while receiving ``recv`` segments from the left.

        With ``reduce_with``, each received segment lands in a scratch buffer and
        ``recv[k] = base[k] (op) received`` (``base`` defaults to ``recv``: in place);
        otherwise it lands in ``recv[k]`` directly.
        """
        depth = self.in_flight
        scratch = None
        if reduce_with is not None and recv:
            scratch = self._buffers(recv[0], max(s.numel() for s in recv), depth)
        base = base or recv
        pending: deque = deque()
        sends = []
        for k in range(max(len(send), len(recv))):
            # Post the receive before the send so the peer's data has a home when it arrives.
            if k < len(recv):
                got = recv[k] if scratch is None else scratch[k % depth][: recv[k].numel()]
                pending.append((dist.irecv(got, g.left, group=g.group), got, recv[k], base[k]))
            if k < len(send):
                sends.append(dist.isend(send[k], g.right, group=g.group))
            while len(pending) >= depth:
                self._land(pending.popleft(), reduce_with)
        while pending:
            self._land(pending.popleft(), reduce_with)
        for work in sends:
            work.wait()

    @staticmethod
    def _land(item, reduce_with: ops.Kernel | None) -> None:
        work, got, out, base = item
        work.wait()
        if reduce_with is not None:
            reduce_with(out, base, got)

    def _reduce_scatter_chunks(self, g: GroupView, chunks: list[torch.Tensor], op: str) -> int:
        """Reduce in place so this rank ends up owning the full reduction of one chunk.

        Returns the index of that chunk, ``(rank + 1) % size``.
        """
        p, r, kern = g.size, g.rank, ops.kernel(op)
        for s in range(p - 1):
            send = self.segments(chunks[(r - s) % p])
            recv = self.segments(chunks[(r - s - 1) % p])
            self._step(g, send, recv, kern)
        return (r + 1) % p

    def _all_gather_chunks(self, g: GroupView, chunks: list[torch.Tensor], owned: int) -> None:
        """Circulate each rank's complete chunk (``owned`` is this rank's) to everyone."""
        p = g.size
        for s in range(p - 1):
            send = self.segments(chunks[(owned - s) % p])
            recv = self.segments(chunks[(owned - s - 1) % p])
            self._step(g, send, recv, None)

    # -- collectives --------------------------------------------------------------------
    # The public layer (ddpkit.comm.collectives) hands these 1-D contiguous tensors,
    # never op "avg" (it sums and divides), and never a group of one.

    def all_reduce(self, tensor: torch.Tensor, op: str, group=None) -> None:
        g = view(group)
        chunks = [tensor[a:b] for a, b in split(tensor.numel(), g.size)]
        owned = self._reduce_scatter_chunks(g, chunks, op)
        self._all_gather_chunks(g, chunks, owned)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group=None
    ) -> None:
        g = view(group)
        # The caller's input must survive, so partial sums go to two staging blocks
        # (out = own block (op) received) instead of into the input; the schedule is
        # all_reduce's shifted by one so the last block reduced here is this rank's own.
        p, r, kern = g.size, g.rank, ops.kernel(op)
        m = output.numel()
        blocks = [input[i * m : (i + 1) * m] for i in range(p)]
        stage = [torch.empty_like(output) for _ in range(min(2, p - 2))]
        sending = blocks[(r - 1) % p]
        for s in range(p - 1):
            out = output if s == p - 2 else stage[s % 2]
            own = blocks[(r - s - 2) % p]
            self._step(g, self.segments(sending), self.segments(out), kern, self.segments(own))
            sending = out

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None) -> None:
        g = view(group)
        m = input.numel()
        chunks = [output[i * m : (i + 1) * m] for i in range(g.size)]
        chunks[g.rank].copy_(input)
        self._all_gather_chunks(g, chunks, g.rank)

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
