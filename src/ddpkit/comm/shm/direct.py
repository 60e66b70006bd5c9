"""A repeated small all-reduce with nothing in front of the reduction but what must be.

``all_reduce(t)`` of one op and dtype on one host, called again and again (a metric, a
loss, a flag: what ``ddpkit.comm``'s remembered path and torch's routed all_reduce
make), spends most of its time on per-call Python rather than on the bytes: the
generic :meth:`ShmCollectives.all_reduce` re-derives the op's name and signature word,
flattens the tensor, builds a meta tuple, publishes it word by word through numpy.
:class:`DirectAllReduce` is bound to one communicator, op and dtype once, and per call
does only the steps of the one-barrier small path (``_reduce_small``): copy the tensor
into this call's area, publish (numel, signature word), barrier, check the peers'
words, reduce every rank's area in rank order into the tensor. The tensor keeps its
shape (the area views are made in it and remembered), so no flat view is made per
call. Results are bit for bit those of the generic path, which it takes itself for a
message above the small size and for a communicator that was closed.
"""

from __future__ import annotations

import torch

from ddpkit.comm import ops
from ddpkit.comm.shm.shm_collectives import SMALL_BYTES

_META = 4  # words per meta slot: numel, signature word, allocation, offset (as all calls)
_MAX_SHAPES = 256  # area views remembered per parity before starting over


class DirectAllReduce:
    """``all_reduce(tensor, op)`` on ``comm`` for CPU tensors of ``dtype``; the call is
    checked in-band with signature ``word``, as the generic path checks it.

    The caller passes a contiguous CPU tensor of ``dtype`` (any shape). Every rank of the
    communicator's group makes its calls in the same order, through this object or the
    generic path (each call is one call of the communicator's, either way).
    """

    __slots__ = ("comm", "op", "word", "kernel", "divisor", "limit", "me", "areas",
                 "published", "peers_meta", "rest")

    def __init__(self, comm, op: str, dtype: torch.dtype, word: int):
        self.comm = comm
        self.op = op
        self.word = word
        self.kernel = ops.kernel(op)
        # avg is a sum divided by the group size inside the pass (one host: size = local)
        self.divisor = comm.view.size if op == "avg" and comm.view.size != 1 else None
        self.limit = SMALL_BYTES // dtype.itemsize  # elements the small path takes
        control = comm.control
        self.me = comm.me
        self.areas: tuple[dict, dict] = ({}, {})  # per parity: shape -> every rank's view
        self.published = [control.meta_index(comm.me, _META, p) for p in (0, 1)]
        self.peers_meta = [[control.meta_index(r, _META, p) for r in control.peers]
                           for p in (0, 1)]
        self.rest = list(range(2, comm.local_size))  # areas reduced after the first two

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        numel = tensor.numel()
        if numel > self.limit or comm._closed:
            return comm.all_reduce(tensor, self.op, signature=self.word)
        parity = comm._calls & 1
        comm._calls += 1
        shape = tensor.shape
        areas = self.areas[parity].get(shape)
        if areas is None:
            areas = self._areas(parity, shape, tensor.dtype)
        areas[self.me].copy_(tensor)
        control = comm.control
        cells, word = control.cells, self.word
        at = self.published[parity]
        # (numel, word) is what peers compare; the slot's other two words place a large
        # message in shared memory, and no call that could meet this one reads them
        cells[at] = numel
        cells[at + 1] = word
        control.barrier()
        for peer_at in self.peers_meta[parity]:
            if cells[peer_at] != numel or cells[peer_at + 1] != word:
                comm._disagreed((numel, word, -1, -1), parity)
        kernel = self.kernel
        kernel(tensor, areas[0], areas[1])
        for r in self.rest:
            kernel(tensor, tensor, areas[r])
        if self.divisor is not None:
            tensor.div_(self.divisor)
        return tensor

    def _areas(self, parity: int, shape: torch.Size, dtype: torch.dtype) -> list:
        nbytes = shape.numel() * dtype.itemsize
        found = [a[:nbytes].view(dtype).view(shape) for a in self.comm._small[parity]]
        if len(self.areas[parity]) >= _MAX_SHAPES:  # many distinct shapes: do not grow forever
            self.areas[parity].clear()
        self.areas[parity][shape] = found
        return found
