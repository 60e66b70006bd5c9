"""The shared-memory collectives for ranks on one host: gradients reduced at memory speed.

Between processes on one machine, gloo still moves every byte through TCP loopback.
Here the ranks of a host map one shared segment instead, and an all-reduce is

1. every rank's input sits in its own region of shared memory - copied there from a
   private tensor, or already there when the tensor came from :meth:`allocate` (DDP
   allocates its gradient buckets this way, so backward writes gradients straight
   into shared memory and nothing is copied in);
2. barrier; rank i reduces the i-th 1/L of the elements across the L regions into its
   own region and writes the result back into every peer's region (no one else reads
   or writes that part, so no locking), in cache-sized pieces so the re-read for the
   write-back comes from cache;
3. barrier; every region now holds the full result.

Each chunk is reduced by exactly one rank and copied bit for bit, so all ranks end
with identical values (DDP relies on this to keep replicas in step).

When the group spans hosts the same code runs inside each host and one leader per
host all-reduces the host's partial result over the backend (a gloo subgroup of
leaders), then the leader's copy is read back by its host's ranks: hierarchical
all-reduce, chosen automatically from the ranks' host identities. The other collectives
take the same shape across hosts (:mod:`ddpkit.comm.shm.hierarchical`).

Broadcast, all-gather, reduce-scatter and reduce move data through each rank's scratch
slot in pieces, with the same check of the call at its first barrier. All of them are
methods of
:class:`~ddpkit.comm.shm.communicator.ShmCommunicator` (defined here as
:class:`ShmCollectives`, which it inherits).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm import ops
from ddpkit.comm.chunks import chunk_bounds
from ddpkit.comm.shm import hierarchical
from ddpkit.errors import CommError

# Reduce-then-write-back granularity: the piece stays in L2 for the write-back (smaller
# pieces add per-piece overhead, larger ones leave the cache before the write-back).
PIECE_BYTES = 1 << 20
# Up to this size every rank reduces the whole message itself from double-buffered
# areas: one barrier per call instead of two, which is what latency is made of.
SMALL_BYTES = 64 << 10


class ShmCollectives:
    """The collectives of :class:`~ddpkit.comm.shm.communicator.ShmCommunicator`.

    Not used on its own: the methods run on the communicator's segment, slots and
    control block, and check each call with its ``_code`` / ``_arrive_checked``.
    """

    # ------------------------------------------------------------------ all-reduce

    def all_reduce(
        self, tensor: torch.Tensor, op: str | dist.ReduceOp = "sum", *, divisor: int | None = None,
        signature: int | None = None, across_hosts: bool = True,
    ) -> torch.Tensor:
        """Reduce ``tensor`` in place across the group; returns it.

        ``divisor`` divides a sum by a count of your choice (DataParallel's join divides
        by the ranks still training); "avg" is a sum with ``divisor`` = group size. On one
        host the division happens inside the reduction pass, not as another pass.
        ``signature`` replaces the call's own signature word in the in-band check (the
        public layer's: it names the collective the user called, e.g. "reduce").
        ``across_hosts=False`` reduces among this host's ranks only (the first step of the
        hierarchical collectives).
        """
        self._check_open()
        name, code = self._code("all_reduce", op, tensor.dtype)
        if tensor.device.type != "cpu":
            raise CommError(f"shm all_reduce needs a CPU tensor, got one on {tensor.device}")
        if signature is not None:
            code = signature
        if name == "avg" and divisor is None:
            divisor = self.view.size
        if divisor is not None and (name not in ("sum", "avg") or not tensor.is_floating_point()):
            raise CommError(f"divisor= needs op 'sum' or 'avg' on a floating tensor, got {name!r} "
                            f"on {tensor.dtype}")
        flat = self._flat(tensor)
        local_op = "sum" if name == "avg" else name
        in_pass = divisor if (self.nhosts == 1 or not across_hosts) and divisor != 1 else None
        parity = self._next_call()
        # Which path runs must be decided identically on every rank, from what all of
        # them see: a rank may hold a private tensor where its peers hold an allocated
        # one (a joined rank's stand-in gradients, say). Small messages take the small
        # path whatever their memory; larger ones are reduced in place only when every
        # rank's tensor sits at the same place of the same allocation.
        if flat.numel() * flat.element_size() <= SMALL_BYTES:
            where = None
            self._reduce_small(flat, local_op, in_pass, (flat.numel(), code, -1, -1), parity)
        else:
            where = self._find(flat)
            meta = (flat.numel(), code, -1, -1) if where is None else (flat.numel(), code, *where)
            if not self._arrive_checked(meta, parity):
                where = None
            if where is None:
                self._reduce_through_slots(flat, local_op, in_pass)
            else:
                self._reduce_in_place(flat, where, local_op, in_pass)
        if self.nhosts > 1 and across_hosts:
            hierarchical.all_reduce_across(self, flat, where, local_op, divisor)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def _reduce_small(self, flat, op, divisor, meta, parity) -> None:
        """One barrier: publish, then every rank reduces everything itself, in the same
        rank order (so results agree bit for bit). The area used alternates between
        calls: a peer may still be reading this call's data while we start the next."""
        key = (parity, flat.numel(), flat.dtype)
        areas = self._small_views.get(key)
        if areas is None:
            nbytes = flat.numel() * flat.element_size()
            areas = [a[:nbytes].view(flat.dtype) for a in self._small[parity]]
            if len(self._small_views) > 256:  # many distinct sizes: do not grow forever
                self._small_views.clear()
            self._small_views[key] = areas
        areas[self.me].copy_(flat)
        self._arrive_checked(meta, parity)
        if self.local_size > 1:
            kernel = ops.kernel(op)
            kernel(flat, areas[0], areas[1])
            for area in areas[2:]:
                kernel(flat, flat, area)
        if divisor is not None:
            flat.div_(divisor)

    def _reduce_in_place(self, flat, where, op, divisor) -> None:
        """Every rank's tensor is in shared memory already (checked at arrival)."""
        start, stop = where[1], where[1] + flat.numel() * flat.element_size()
        regions = [r[start:stop].view(flat.dtype) for r in self._regions(where[0])]
        self._reduce_my_chunk(regions, op, divisor)
        self.control.barrier()

    def _reduce_through_slots(self, flat, op, divisor) -> None:
        """A private tensor, in pieces of half a slot. Only the parts peers reduce are
        copied in; each rank reduces its chunk from its own private memory and peers'
        slots, publishes the result in its slot, and everyone copies out the others'
        results. Pieces alternate slot halves: a peer may still be copying out of the
        previous piece while this one is copied in."""
        numel, itemsize = flat.numel(), flat.element_size()
        step = len(self._halves[0][0]) // itemsize
        kernel = ops.kernel(op)
        for start in range(0, max(numel, 1), step):
            count = min(numel - start, step)
            parity = self._next_half()
            slots = [h[: count * itemsize].view(flat.dtype) for h in self._halves[parity]]
            mine, piece = slots[self.me], flat[start:start + count]
            bounds = chunk_bounds(count, itemsize, self.local_size)
            lo, hi = bounds[self.me], bounds[self.me + 1]
            # peers need every chunk but the one this rank reduces: before it and after
            mine[:lo].copy_(piece[:lo])
            mine[hi:].copy_(piece[hi:])
            self.control.barrier()
            acc = piece[lo:hi]
            for peer in self.control.peers:
                kernel(acc, acc, slots[peer][lo:hi])
            if divisor is not None:
                acc.div_(divisor)
            mine[lo:hi].copy_(acc)
            self.control.barrier()
            for peer in self.control.peers:
                a, b = bounds[peer], bounds[peer + 1]
                piece[a:b].copy_(slots[peer][a:b])

    def _reduce_my_chunk(self, regions: list[torch.Tensor], op: str, divisor) -> None:
        bounds = chunk_bounds(regions[0].numel(), regions[0].element_size(), self.local_size)
        lo, hi = bounds[self.me], bounds[self.me + 1]
        mine = regions[self.me]
        others = [r for i, r in enumerate(regions) if i != self.me]
        kernel = ops.kernel(op)
        piece = max(1, PIECE_BYTES // mine.element_size())
        for start in range(lo, hi, piece):
            stop = min(hi, start + piece)
            acc = mine[start:stop]
            for other in others:
                kernel(acc, acc, other[start:stop])
            if divisor is not None:
                acc.div_(divisor)
            for other in others:
                other[start:stop].copy_(acc)

    # ------------------------------------------------------------------ the other collectives
    # Each call's first barrier carries its signature, as all_reduce's does; data moves
    # through the slot halves in pieces, the halves alternating as above. Across hosts
    # each of them is hierarchical (comm/shm/hierarchical.py): these host-local steps
    # inside each host, the backend between the hosts' leaders.

    def barrier(self, *, signature: int | None = None) -> None:
        """Wait until every rank of the group has arrived (one shared-memory barrier)."""
        self._check_open()
        code = signature if signature is not None else self._code("barrier", "-", None)[1]
        parity = self._next_call()
        self._arrive_checked((0, code, -1, -1), parity)
        if self.nhosts > 1:
            hierarchical.barrier_across(self)

    def broadcast(self, tensor: torch.Tensor, src: int, *, signature: int | None = None
                  ) -> torch.Tensor:
        """Copy ``tensor`` from global rank ``src`` to every rank, in place; returns it."""
        self._check_open()
        self.view.group_rank_of(src, "src")
        code = signature if signature is not None else self._code(
            "broadcast", "-", tensor.dtype, src)[1]
        flat = self._flat(tensor)
        if self.nhosts > 1:
            hierarchical.broadcast_across(self, flat, src, code)
        else:
            root = self._local_of(src, "src")
            self._send_from(root, flat, flat.numel(), flat.dtype, code, self._into(flat))
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def _send_from(self, root: int, source: torch.Tensor | None, numel: int,
                   dtype: torch.dtype, code: int, sink=None) -> None:
        """Local rank ``root`` sends ``numel`` elements of ``source`` to this host's other
        ranks through its slot halves, piece by piece; each of them hands every piece
        to ``sink(start, piece)`` (a view of the root's slot, to copy out of before
        returning; None: this rank takes nothing). Collective over the host's ranks."""
        step = len(self._halves[0][0]) // dtype.itemsize
        parity, sender = self._next_call(), self.me == root
        for start in range(0, max(numel, 1), step):
            count = min(numel - start, step)
            half = self._next_half()
            if sender:
                self._area(half, self.me, count, dtype).copy_(source[start:start + count])
            if start == 0:
                self._arrive_checked((numel, code, -1, -1), parity)
            else:
                self.control.barrier()
            if not sender and sink is not None:
                sink(start, self._area(half, root, count, dtype))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   signature: int | None = None) -> torch.Tensor:
        """Concatenate every rank's ``input`` into ``output`` in group-rank order."""
        self._check_open()
        code = signature if signature is not None else self._code(
            "all_gather", "-", input.dtype)[1]
        src, out = self._flat(input, "input"), self._flat(output, "output")
        m, dtype = src.numel(), src.dtype
        if out.numel() != m * self.view.size or out.dtype != dtype:
            raise CommError(f"all_gather: output must hold {self.view.size} x {m} {dtype} "
                            f"elements, got {out.numel()} {out.dtype}")
        if self.nhosts > 1:
            hierarchical.all_gather_across(self, out, src, code)
        else:
            self._gather_local(out, src, code)
        if out.data_ptr() != output.data_ptr():
            output.copy_(out.view_as(output))
        return output

    def _gather_local(self, out: torch.Tensor, src: torch.Tensor, code: int) -> None:
        """This host's ranks' ``src`` into ``out`` in local-rank order (collective over
        the host's ranks)."""
        m, dtype = src.numel(), src.dtype
        step = len(self._halves[0][0]) // src.element_size()
        parity = self._next_call()
        for start in range(0, max(m, 1), step):
            count = min(m - start, step)
            half = self._next_half()
            self._area(half, self.me, count, dtype).copy_(src[start:start + count])
            if start == 0:
                self._arrive_checked((m, code, -1, -1), parity)
            else:
                self.control.barrier()
            for r in range(self.local_size):
                block = out[r * m + start: r * m + start + count]
                block.copy_(src[start:start + count] if r == self.me
                            else self._area(half, r, count, dtype))

    def reduce_scatter_chunks(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum a contiguous 1-D ``flat`` so that this rank's chunk of it,
        ``chunk_bounds(numel, itemsize, ranks)[me:me + 2]``, holds the result, added in
        exactly the order :meth:`all_reduce` adds it (a sharded optimizer's gradients
        then carry the unsharded engine's bits); the rest of ``flat`` is left as it was,
        except where the message is small enough for all_reduce's one-barrier path,
        which is then taken whole. One host; ``flat`` may be private: peers' parts of
        this rank's chunk arrive through the slot halves."""
        self._check_open()
        self._single_host("reduce_scatter_chunks")
        if not flat.is_contiguous() or flat.dim() != 1:
            raise CommError(f"reduce_scatter_chunks needs a contiguous 1-D tensor, got shape "
                            f"{tuple(flat.shape)}")
        if flat.numel() * flat.element_size() <= SMALL_BYTES:
            return self.all_reduce(flat, "sum")
        code = self._code("reduce_scatter", "sum", flat.dtype)[1]
        n, dtype = self.local_size, flat.dtype
        bounds = chunk_bounds(flat.numel(), flat.element_size(), n)
        sizes = [bounds[r + 1] - bounds[r] for r in range(n)]
        step = max(1, len(self._halves[0][0]) // (flat.element_size() * n))
        kernel = ops.kernel("sum")
        parity = self._next_call()
        for start in range(0, max(max(sizes), 1), step):
            half = self._next_half()
            # my half holds, at block j, the piece of chunk j that rank j sums
            staged = self._area(half, self.me, n * step, dtype)
            for j in self.control.peers:
                count = max(0, min(sizes[j] - start, step))
                if count:
                    at = bounds[j] + start
                    staged[j * step:j * step + count].copy_(flat[at:at + count])
            if start == 0:
                self._arrive_checked((flat.numel(), code, -1, -1), parity)
            else:
                self.control.barrier()
            count = max(0, min(sizes[self.me] - start, step))
            if count:
                at = bounds[self.me] + start
                acc = flat[at:at + count]
                for peer in self.control.peers:  # own part first, then rank order
                    theirs = self._area(half, peer, n * step, dtype)
                    kernel(acc, acc, theirs[self.me * step:self.me * step + count])
        return flat

    def all_gather_chunks(self, flat: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """In place on a contiguous 1-D ``flat``: every rank gets group rank r's elements
        ``flat[bounds[r]:bounds[r + 1]]`` from rank r (uneven chunks, e.g. the shards a
        sharded optimizer has just updated). One host; pieces go through the slot halves,
        so peers touch no memory of each other's but the slots."""
        self._check_open()
        self._single_host("all_gather_chunks")
        if not flat.is_contiguous() or flat.dim() != 1 or len(bounds) != self.local_size + 1:
            raise CommError(f"all_gather_chunks needs a contiguous 1-D tensor and "
                            f"{self.local_size + 1} bounds, got shape {tuple(flat.shape)} and "
                            f"{len(bounds)} bounds")
        code = self._code("all_gather", "-", flat.dtype)[1]
        sizes = [bounds[r + 1] - bounds[r] for r in range(self.local_size)]
        step = len(self._halves[0][0]) // flat.element_size()
        parity = self._next_call()
        for start in range(0, max(max(sizes), 1), step):
            half = self._next_half()
            count = max(0, min(sizes[self.me] - start, step))
            if count:
                at = bounds[self.me] + start
                self._area(half, self.me, count, flat.dtype).copy_(flat[at:at + count])
            if start == 0:
                self._arrive_checked((flat.numel(), code, -1, -1), parity)
            else:
                self.control.barrier()
            for peer in self.control.peers:
                theirs = max(0, min(sizes[peer] - start, step))
                if theirs:
                    at = bounds[peer] + start
                    flat[at:at + theirs].copy_(self._area(half, peer, theirs, flat.dtype))
        return flat

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       op: str | dist.ReduceOp = "sum", *, signature: int | None = None
                       ) -> torch.Tensor:
        """Reduce ``input`` (group size x ``output.numel()``) across ranks; rank i gets
        block i of the result in ``output``. On one host each rank reduces only its own
        block."""
        self._check_open()
        name, code = self._code("reduce_scatter", op, input.dtype)
        if signature is not None:
            code = signature
        src, out = self._flat(input, "input"), self._flat(output, "output")
        m, dtype, n = out.numel(), src.dtype, self.view.size
        if src.numel() != m * n or out.dtype != dtype:
            raise CommError(f"reduce_scatter: input must hold {n} x {m} {out.dtype} elements, "
                            f"got {src.numel()} {dtype}")
        if self.nhosts > 1:
            hierarchical.reduce_scatter_across(self, out, src, name, code)
        else:
            self._reduce_scatter_local(out, src, name, code)
        if out.data_ptr() != output.data_ptr():
            output.copy_(out.view_as(output))
        return output

    def _reduce_scatter_local(self, out: torch.Tensor, src: torch.Tensor, name: str,
                              code: int) -> None:
        """One host: every rank stages the pieces its peers reduce, then reduces its own."""
        m, dtype, n = out.numel(), src.dtype, self.local_size
        step = max(1, len(self._halves[0][0]) // (src.element_size() * n))
        kernel = ops.kernel(name)
        parity = self._next_call()
        for start in range(0, max(m, 1), step):
            count = min(m - start, step)
            half = self._next_half()
            # my half holds, at block j, the piece of my input block j that rank j reduces
            staged = self._area(half, self.me, n * count, dtype)
            for j in self.control.peers:
                staged[j * count:(j + 1) * count].copy_(src[j * m + start: j * m + start + count])
            if start == 0:
                self._arrive_checked((m, code, -1, -1), parity)
            else:
                self.control.barrier()
            acc = out[start:start + count]
            own = src[self.me * m + start: self.me * m + start + count]
            if n == 1:
                acc.copy_(own)
            for k, peer in enumerate(self.control.peers):
                theirs = self._area(half, peer, n * count, dtype)[
                    self.me * count:(self.me + 1) * count]
                kernel(acc, own if k == 0 else acc, theirs)
        if name == "avg":
            out.div_(self.view.size)

    def reduce(self, tensor: torch.Tensor, dst: int, op: str | dist.ReduceOp = "sum", *,
               signature: int | None = None) -> torch.Tensor:
        """Reduce onto global rank ``dst`` (in place there; other ranks' tensors stay as
        they were). On one host: an all-reduce whose non-destination ranks work on a
        copy."""
        self._check_open()
        name, code = self._code("reduce", op, tensor.dtype, dst)
        if signature is not None:
            code = signature
        self.view.group_rank_of(dst, "dst")
        if self.nhosts > 1:
            flat = self._flat(tensor)
            hierarchical.reduce_across(self, flat, dst, name, code)
            if flat.data_ptr() != tensor.data_ptr() and self._is(dst):
                tensor.copy_(flat.view_as(tensor))
            return tensor
        work = tensor if self._is(dst) else tensor.clone()
        self.all_reduce(work, name, signature=code)
        return tensor

    @staticmethod
    def _into(flat: torch.Tensor):
        """A :meth:`_send_from` sink that lands each piece at its place in ``flat``."""
        def sink(start: int, piece: torch.Tensor) -> None:
            flat[start:start + piece.numel()].copy_(piece)
        return sink

