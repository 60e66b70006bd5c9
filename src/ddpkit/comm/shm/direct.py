"""A repeated small all-reduce with nothing in front of the reduction but what must be.

``all_reduce(t)`` of one op and dtype on one host, called again and again (a metric, a
loss, a flag: what ``ddpkit.comm``'s remembered path and torch's routed all_reduce
make), spends most of its time on per-call Python rather than on the bytes: the
generic :meth:`ShmCollectives.all_reduce` re-derives the op's name and signature word,
flattens the tensor, builds a meta tuple, publishes it word by word through numpy.
:class:`DirectAllReduce` is bound to one communicator, op and dtype once, and per call
does only the steps of the one-barrier small path (``_reduce_small``): copy the tensor
into this call's area, publish (numel, signature word), barrier, check the peers'
words, reduce every rank's area in rank order into the tensor (the reduction's torch
function called with out=, as the generic path's kernel calls it). The tensor keeps its
shape (the area views are made in it and remembered), so no flat view is made per
call. The copy in is a ``memmove``, or, from an address met before (a tensor used
again), a numpy copy from a view of those bytes made once. The reduction stays torch's:
numpy's add and min/max of floats can differ from torch's in the bits of a NaN and
the sign of a zero, and warn on overflow where torch does not. Results are bit for bit
those of the generic path, which it takes itself for a message above the small size and
for a communicator that was closed.
"""

from __future__ import annotations

from ctypes import c_char, memmove

import numpy as np
import torch

from ddpkit.comm import ops
from ddpkit.comm.shm.shm_collectives import SMALL_BYTES

_META = 4  # words per meta slot: numel, signature word, allocation, offset (as all calls)
_MAX_SHAPES = 256  # area views remembered per parity before starting over
_MAX_ADDRESSES = 16  # callers' addresses remembered per parity and shape


class DirectAllReduce:
    """``all_reduce(tensor, op)`` on ``comm`` for CPU tensors of ``dtype``; the call is
    checked in-band with signature ``word``, as the generic path checks it.

    The caller passes a contiguous CPU tensor of ``dtype`` (any shape). Every rank of the
    communicator's group makes its calls in the same order, through this object or the
    generic path (each call is one call of the communicator's, either way).
    """

    __slots__ = ("comm", "op", "word", "reduce", "divisor", "limit", "itemsize", "me",
                 "areas", "published", "peers_meta", "rest")

    def __init__(self, comm, op: str, dtype: torch.dtype, word: int):
        self.comm = comm
        self.op = op
        self.word = word
        self.reduce = ops.kernel_function(op)  # called as reduce(a, b, out=tensor)
        # avg is a sum divided by the group size inside the pass (one host: size = local)
        self.divisor = comm.view.size if op == "avg" and comm.view.size != 1 else None
        self.limit = SMALL_BYTES // dtype.itemsize  # elements the small path takes
        self.itemsize = dtype.itemsize
        control = comm.control
        self.me = comm.me
        self.areas: tuple[dict, dict] = ({}, {})  # per parity: shape -> every rank's view
        self.published = [control.meta_index(comm.me, _META, p) for p in (0, 1)]
        self.peers_meta = [[control.meta_index(r, _META, p) for r in control.peers]
                           for p in (0, 1)]
        self.rest = comm.local_size > 2  # areas to reduce after the first two

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        numel = tensor.numel()
        if numel > self.limit or comm._closed or tensor.is_neg():
            # (a negative view's bytes are not its values: the generic path copies values)
            return comm.all_reduce(tensor, self.op, signature=self.word)
        calls = comm._calls
        comm._calls = calls + 1
        parity = calls & 1
        found = self.areas[parity].get(tensor.shape)
        if found is None:
            found = self._areas(parity, tensor.shape, tensor.dtype)
        areas, mine, at_mine, copies = found
        if numel:
            # the bytes of a contiguous CPU tensor into this rank's area: what copy_ does,
            # without its dispatch; from an address met before, a numpy copy between
            # views made once (a fraction of a foreign call's cost), else memmove
            ptr = tensor.data_ptr()
            source = copies.get(ptr)
            if source is None:
                memmove(at_mine, ptr, numel * self.itemsize)
                self._met(copies, ptr, numel * self.itemsize)
            else:
                mine[...] = source
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
        reduce = self.reduce
        reduce(areas[0], areas[1], out=tensor)
        if self.rest:
            for area in areas[2:]:
                reduce(tensor, area, out=tensor)
        if self.divisor is not None:
            tensor.div_(self.divisor)
        return tensor

    def _areas(self, parity: int, shape: torch.Size, dtype: torch.dtype) -> tuple:
        """Every rank's area of this parity viewed in ``shape``; this rank's bytes as a
        numpy array, and their address; the copies from callers' addresses (:meth:`_met`)."""
        nbytes = shape.numel() * dtype.itemsize
        areas = [a[:nbytes].view(dtype).view(shape) for a in self.comm._small[parity]]
        if len(self.areas[parity]) >= _MAX_SHAPES:  # many distinct shapes: do not grow forever
            self.areas[parity].clear()
        mine = self.comm._small[parity][self.me][:nbytes]
        found = self.areas[parity][shape] = (areas, mine.numpy(), mine.data_ptr(), {})
        return found

    @staticmethod
    def _met(copies: dict, ptr: int, nbytes: int) -> None:
        """A caller's tensor at ``ptr`` was copied in: the second time an address is met
        (a tensor used again, or a new one where the allocator put the last), a numpy
        view of its bytes is made to copy from next time. The view does not own or keep
        the memory: it is read only in a call whose tensor of this shape starts at
        ``ptr``, so those bytes are that tensor's."""
        if ptr not in copies:
            copies[ptr] = None  # met once
            if len(copies) > _MAX_ADDRESSES:  # addresses that never repeat: start over
                copies.clear()
            return
        copies[ptr] = np.frombuffer((c_char * nbytes).from_address(ptr), dtype=np.uint8)
