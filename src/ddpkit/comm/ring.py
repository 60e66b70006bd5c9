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
so a segment sent by rank r has exactly the size rank r+1 posted for it. That holds only
if every rank made the same call, and gloo aborts the process on a size mismatch, so
each call first sends a fixed-size *header* around the ring (``RingAlgorithm._agree``):
the call's signature row (:class:`ddpkit.comm.agreement.CallSignature`) followed by
:data:`HEADER_PAYLOAD_BYTES` bytes of payload room, forwarded for P-1 hops until every
rank holds every rank's header, checked before any result is written or any payload
receive is posted. Headers are the same size on every rank whatever the call, so they
cannot trip gloo's size check, and a mismatch or a refusal becomes the same CommError
on every rank with the group left clean. This is the ring's in-band agreement
(``in_band`` is True): the public layer skips its separate agreement all-gather.

A call whose payload fits in the header's room (``inline_bytes``) finishes inside the
header pass: every rank then holds every rank's payload and computes its result itself,
reducing in group-rank order so every rank gets the same bits. Small calls therefore
cost one exchange of P-1 hops instead of a check plus 2(P-1) ring steps; larger calls
run the ring after the header.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit.comm import ops
from ddpkit.comm.agreement import ROW_WORDS
from ddpkit.comm.groups import GroupView, view


@dataclass(frozen=True)
class Step:
    """One ring step as seen by the receiving rank: where the incoming chunk goes."""

    out: torch.Tensor
    base: torch.Tensor | None = None  # reduce into out = base (op) received; None: out
    reduce: bool = False
    divide: int = 1  # then divide out by this ("avg": the step that completes a sum)


# Bytes of payload room in every header (the wire format: every rank's ring must use the
# same, or the headers' sizes differ and gloo aborts). Chosen by measurement
# (benchmarks/ring_agreement.py, benchmarks/RESULTS.md).
HEADER_PAYLOAD_BYTES = 64 << 10
_ROW_BYTES = ROW_WORDS * 8


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, stop) ranges covering ``range(n)``, sizes differing by <= 1."""
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


class RingAlgorithm:
    """Ring collectives with chunks cut into segments of at most ``segment_bytes``.

    ``min_segments``: at least this many segments per chunk (so even small chunks
    pipeline). ``in_flight``: receives posted ahead of the one being reduced.
    ``segment_bytes=None`` with ``min_segments=1, in_flight=1`` is the tutorial's
    unsegmented ring, kept as "naive_ring" for comparison. ``inline_bytes``: calls whose
    payload is at most this many bytes finish inside the header pass (default None: the
    header's whole room, :data:`HEADER_PAYLOAD_BYTES`; 0 always runs the ring, as the
    tests do to cover it on small tensors). It changes no message size, so rings that
    differ in it still meet, and the header names the algorithm, so they refuse together.
    """

    def __init__(
        self,
        segment_bytes: int | None = 1 << 20,
        *,
        min_segments: int = 2,
        in_flight: int = 2,
        inline_bytes: int | None = None,
    ):
        if segment_bytes is not None and segment_bytes < 1:
            raise ValueError(f"segment_bytes must be positive or None, got {segment_bytes}")
        if min_segments < 1 or in_flight < 1:
            raise ValueError("min_segments and in_flight must be >= 1")
        if inline_bytes is not None and not 0 <= inline_bytes <= HEADER_PAYLOAD_BYTES:
            raise ValueError(
                f"inline_bytes must be in [0, {HEADER_PAYLOAD_BYTES}], got {inline_bytes}")
        self.inline_bytes = inline_bytes
        self.segment_bytes = segment_bytes
        self.min_segments = min_segments
        self.in_flight = in_flight
        self._scratch = threading.local()  # one set per thread: async lanes run beside callers

    def __repr__(self) -> str:
        return (
            f"RingAlgorithm(segment_bytes={self.segment_bytes}, "
            f"min_segments={self.min_segments}, in_flight={self.in_flight}, "
            f"inline_bytes={self.inline_bytes})"
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
                if steps[t].divide != 1:  # before it is forwarded: peers get the average
                    out.div_(steps[t].divide)
            if t + 1 < len(steps):
                work = dist.isend(out, g.right, group=g.group)
                sends.append(work)
                sending[out.data_ptr()] = work
            post_ahead()
        for work in sends:
            work.wait()

    # -- the in-band agreement ----------------------------------------------------------

    def in_band(self, group) -> bool:
        """Every ring call checks its signature itself (the header): no all-gather."""
        return True

    def refuse(self, signature, group=None) -> None:
        """This rank refused the call locally: send its header (problem flag set) so
        the peers raise at the header check; the caller then raises its own error."""
        g = view(group)
        if g is not None and g.size > 1:
            self._agree(g, signature)

    def _table(self, p: int) -> torch.Tensor:
        """This thread's (p, header size) byte table, reused: every send and receive on
        it has finished before a call returns."""
        key = ("headers", p, HEADER_PAYLOAD_BYTES)
        cache = self._scratch.__dict__
        table = cache.get(key)
        if table is None:
            table = cache[key] = torch.empty((p, _ROW_BYTES + HEADER_PAYLOAD_BYTES),
                                             dtype=torch.uint8)
        return table

    def _exchange(self, g: GroupView, row: list[int],
                  payload: torch.Tensor | None = None) -> torch.Tensor:
        """Every group rank's header, in group-rank order, passed around the ring: a
        (P, header size) byte table whose row i is rank i's signature words, then its
        payload (where it sent one) from byte :data:`_ROW_BYTES` on.

        This rank's header goes right and all P-1 header receives are posted at once;
        each header that arrives (but the last) is forwarded right, so after P-1 hops
        every rank holds every header. One fixed-size message per hop and rank, on the
        group the payload will use, in the same per-peer posting order as any payload
        after it.
        """
        p, r = g.size, g.rank
        table = self._table(p)
        table[r, :_ROW_BYTES].view(torch.int64).copy_(torch.tensor(row, dtype=torch.int64))
        if payload is not None and payload.numel() > 0:
            _inline(table[r], payload).copy_(payload)
        # every receive is posted before the first wait, so no forwarding hop waits on
        # a receive posted late (gloo sends only into a posted receive)
        sends = [dist.isend(table[r], g.right, group=g.group)]
        recvs = [dist.irecv(table[(r - h - 1) % p], g.left, group=g.group)
                 for h in range(p - 1)]
        for h in range(p - 1):
            recvs[h].wait()
            if h + 1 < p - 1:  # forward what just arrived
                sends.append(dist.isend(table[(r - h - 1) % p], g.right, group=g.group))
        for work in sends:
            work.wait()
        return table

    def _agree(self, g: GroupView, signature,
               payload: torch.Tensor | None = None) -> torch.Tensor | None:
        """The header pass and its verdict: returns the header table only if every rank
        made this call (so a caller may then read the peers' payloads).
        ``signature=None`` (the algorithm called directly, not through ddpkit.comm's
        functions) skips it and returns None: such callers guarantee agreement
        themselves, and their calls always run the ring."""
        if signature is None:
            return None
        table = self._exchange(g, signature.row(), payload)
        signature.verdict(table[:, :_ROW_BYTES].view(torch.int64).tolist())
        return table

    def _fits(self, signature, payload: torch.Tensor) -> bool:
        """Whether this call finishes inside the header pass. Depends only on the
        signature (size and dtype), so once the verdict has passed every rank decided
        alike."""
        if signature is None:
            return False
        room = HEADER_PAYLOAD_BYTES if self.inline_bytes is None else self.inline_bytes
        return payload.numel() * payload.element_size() <= room

    def _reduce_inline(self, out: torch.Tensor, parts: list[torch.Tensor], op: str) -> None:
        """out = parts[0] (op) parts[1] (op) ... in group-rank order, the same on every
        rank whatever its own rank, then divided for "avg"."""
        kern = ops.kernel(op)
        kern(out, parts[0], parts[1])
        for part in parts[2:]:
            kern(out, out, part)
        if op == "avg":
            out.div_(len(parts))

    # -- collectives --------------------------------------------------------------------
    # The public layer (ddpkit.comm.collectives) hands these 1-D contiguous tensors
    # (empty ones too: the header must still be checked), op "avg" (divided here),
    # and never a group of one.

    def barrier(self, group=None, *, signature=None) -> None:
        """The header pass alone: no rank can hold every header before every rank has
        sent its own, i.e. entered the barrier."""
        g = view(group)
        if signature is None:
            self._exchange(g, [0] * ROW_WORDS)
        else:
            self._agree(g, signature)

    def all_reduce(self, tensor: torch.Tensor, op: str, group=None, *, signature=None) -> None:
        g = view(group)
        if self._fits(signature, tensor):
            table = self._agree(g, signature, tensor)
            if tensor.numel():
                self._reduce_inline(tensor, [_inline(h, tensor) for h in table], op)
            return
        self._agree(g, signature)
        p, r = g.size, g.rank
        chunks = [tensor[a:b] for a, b in split(tensor.numel(), p)]
        # Reduce-scatter: step t reduces chunk r-t-1 into place; afterwards this rank
        # holds the complete chunk r+1 (divided there for "avg", so the all-gather
        # spreads the average and each rank divides 1/P of the tensor). All-gather:
        # step a receives chunk r-a.
        steps = [Step(chunks[(r - t - 1) % p], reduce=True,
                      divide=p if op == "avg" and t == p - 2 else 1) for t in range(p - 1)]
        steps += [Step(chunks[(r - a) % p]) for a in range(p - 1)]
        self._ring(g, chunks[r], steps, ops.kernel(op))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group=None, *, signature=None
    ) -> None:
        g = view(group)
        p, r = g.size, g.rank
        m = output.numel()
        if self._fits(signature, input):
            # every rank's whole input arrives (headers are forwarded whole); this rank
            # reduces its own block of each
            table = self._agree(g, signature, input)
            if m:
                self._reduce_inline(output, [_inline(h, input)[r * m : (r + 1) * m]
                                             for h in table], op)
            return
        self._agree(g, signature)
        # The caller's input must survive, so partial sums go to staging blocks
        # (out = own block (op) received) instead of into the input; the schedule is
        # all_reduce's shifted by one so the last block reduced here is this rank's own.
        blocks = [input[i * m : (i + 1) * m] for i in range(p)]
        stage = [torch.empty_like(output) for _ in range(min(2, p - 2))]
        steps = [
            Step(output if t == p - 2 else stage[t % 2], base=blocks[(r - t - 2) % p],
                 reduce=True, divide=p if op == "avg" and t == p - 2 else 1)
            for t in range(p - 1)
        ]
        self._ring(g, blocks[(r - 1) % p], steps, ops.kernel(op))

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group=None, *, signature=None
    ) -> None:
        g = view(group)
        m = input.numel()
        chunks = [output[i * m : (i + 1) * m] for i in range(g.size)]
        if self._fits(signature, input):
            table = self._agree(g, signature, input)
            if m:
                for chunk, header in zip(chunks, table):
                    chunk.copy_(_inline(header, input))
            return
        self._agree(g, signature)
        chunks[g.rank].copy_(input)
        steps = [Step(chunks[(g.rank - s - 1) % g.size]) for s in range(g.size - 1)]
        self._ring(g, chunks[g.rank], steps, None)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None, *, signature=None) -> None:
        """A pipelined chain src -> src+1 -> ...: each rank forwards a segment as soon as
        it has landed, so the whole tensor takes one hop's time plus a segment per rank.
        A tensor that fits travels in src's header instead."""
        g = view(group)
        if self._fits(signature, tensor):
            root = g.group_rank_of(src, "src")
            # only src's payload is read; the others send the room empty
            table = self._agree(g, signature, tensor if g.rank == root else None)
            if g.rank != root and tensor.numel():
                tensor.copy_(_inline(table[root], tensor))
            return
        self._agree(g, signature)
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

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: str, group=None, *, signature=None
    ) -> None:
        """A pipelined chain ending at ``dst``: dst+1 sends, each next rank adds its own
        segment and forwards. Only ``dst``'s tensor changes; dst receives the tensor
        once, the least any reduce to one rank can do."""
        g = view(group)
        if self._fits(signature, tensor):
            table = self._agree(g, signature, tensor)
            if g.rank == g.group_rank_of(dst, "dst") and tensor.numel():
                self._reduce_inline(tensor, [_inline(h, tensor) for h in table], op)
            return
        self._agree(g, signature)
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
                if op == "avg":
                    seg.div_(g.size)
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


def _inline(header: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The payload room of one header row, viewed as ``like``'s dtype and size."""
    nbytes = like.numel() * like.element_size()
    return header[_ROW_BYTES : _ROW_BYTES + nbytes].view(like.dtype)
