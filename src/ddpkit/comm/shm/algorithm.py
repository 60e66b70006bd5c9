"""The registry's "shm" and "hierarchical" algorithms, and whether "auto" picks shm.

:mod:`ddpkit.comm.registry` registers :class:`ShmAlgorithm`; it runs every collective
on the group's one :class:`~ddpkit.comm.shm.communicator.ShmCommunicator`
(:func:`group_communicator`, created collectively on first use) and on the backend
where shared memory cannot serve the group. :func:`supports` is what ``algo="auto"``
asks: CPU tensors of a supported dtype, every rank on this host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm import groups, ops
from ddpkit.comm.backend import BackendAlgorithm
from ddpkit.comm.shm import segment
from ddpkit.comm.shm.communicator import ShmCommunicator, host_key
from ddpkit.comm.shm.direct import DirectAllReduce
from ddpkit.comm.shm.signature import signature_word
from ddpkit.comm.shm.sync import memory_model_ok
from ddpkit.errors import CommError
from ddpkit.log import get_logger
from ddpkit.runtime import lifetime

log = get_logger(__name__)

# group -> ShmCommunicator, or None when shm proved unusable; a communicator is closed
# when its group dies (ddpkit.runtime.lifetime)
_communicators = lifetime.PerGroup(on_drop=ShmCommunicator.close)
_hosts = lifetime.PerGroup()  # group -> whether all its ranks share one host
_DTYPES = {ops.dtype_label(d): d for d in ops.DTYPES}  # a signature's dtype name -> dtype


def group_communicator(group: dist.ProcessGroup | None = None) -> ShmCommunicator | None:
    """The shared communicator for ``group`` (created collectively on first use), or None
    when shared memory is unusable here (then the caller falls back to the backend)."""
    marker = _communicators.get(group, _communicators)
    if marker is not _communicators:
        return marker
    try:
        found = ShmCommunicator(group)
    except CommError as exc:
        log.warning(f"shared-memory all_reduce unavailable, using the backend: {exc}")
        found = None
    _communicators.set(group, found)
    return found


def backend_all_reduce(tensor: torch.Tensor, op: str, group=None) -> torch.Tensor:
    name = ops.op_name(op)
    dist.all_reduce(tensor, ops.TO_REDUCE_OP["sum" if name == "avg" else name], group=group)
    if name == "avg":
        tensor.div_(dist.get_world_size(group))
    return tensor


class ShmAlgorithm:
    """The registry's "shm" and "hierarchical": every collective on the group's shared
    :class:`ShmCommunicator`.

    On one host each call's signature rides in its first barrier (``in_band(group)`` is
    True and the public layer skips its separate agreement round trip). Across hosts
    every collective is hierarchical (shm inside each host, the backend between one
    leader per host, see :mod:`ddpkit.comm.shm.hierarchical`), except all_gather and
    reduce_scatter where the hosts' ranks are not consecutive equal blocks of group
    ranks: those use the backend directly (decided from the group's layout, alike on
    every rank). Across hosts the public layer keeps its agreement all-gather, since no
    shared memory spans the hosts. Where shared memory cannot be set up every rank
    learns it at the same collective and every call goes to the backend.
    """

    def __init__(self):
        self._words: dict = {}
        self._backend = BackendAlgorithm()

    def __repr__(self) -> str:
        return "ShmAlgorithm()"

    def in_band(self, group) -> bool:
        comm = group_communicator(group)
        return comm is not None and comm.nhosts == 1

    def _word(self, signature) -> int | None:
        """The shm signature word of the public layer's CallSignature (None: none)."""
        if signature is None:
            return None
        key = (signature.collective, signature.dtype, signature.op, signature.root)
        word = self._words.get(key)
        if word is None:
            word = self._words[key] = signature_word(*key)
        return word

    def _one_host(self, group) -> ShmCommunicator | None:
        comm = group_communicator(group)
        return comm if comm is not None and comm.nhosts == 1 else None

    def _by_blocks(self, group) -> ShmCommunicator | None:
        """The communicator where it can gather and scatter by group rank (one host, or
        hosts holding equal blocks of consecutive ranks), else None: the backend."""
        comm = group_communicator(group)
        return comm if comm is not None and comm.host_blocks else None

    def refuse(self, signature, group=None) -> None:
        """This rank refused the call locally: tell the peers at the call's barrier."""
        comm = self._one_host(group)
        if comm is not None:
            comm.refuse(self._word(signature), max(signature.numel_in, 0))

    def all_reduce(self, tensor, op, group=None, *, signature=None) -> None:
        comm = group_communicator(group)
        if comm is None:
            self._backend.all_reduce(tensor, op, group)
        else:
            comm.all_reduce(tensor, op, signature=self._word(signature))

    def direct_all_reduce(self, op, group=None, *, signature=None):
        """``all_reduce(tensor, op)`` of a contiguous CPU tensor of the signature's dtype
        (any shape), with ``signature`` checked in-band, bound now to the group's
        communicator (the public layer remembers it for repeated calls), or None where
        the call is not in-band."""
        comm = self._one_host(group)
        if comm is None:
            return None
        word = self._word(signature)
        dtype = None if signature is None else _DTYPES.get(signature.dtype)
        if dtype is None or comm.local_size < 2:
            return lambda flat: comm.all_reduce(flat, op, signature=word)
        return DirectAllReduce(comm, op, dtype, word)

    def barrier(self, group=None, *, signature=None) -> None:
        comm = group_communicator(group)
        if comm is None:
            dist.barrier(group=group)
        else:
            comm.barrier(signature=self._word(signature))

    def broadcast(self, tensor, src, group=None, *, signature=None) -> None:
        comm = group_communicator(group)
        if comm is None:
            self._backend.broadcast(tensor, src, group)
        else:
            comm.broadcast(tensor, src, signature=self._word(signature))

    def all_gather(self, output, input, group=None, *, signature=None) -> None:
        comm = self._by_blocks(group)
        if comm is None:
            self._backend.all_gather(output, input, group)
        else:
            comm.all_gather(output, input, signature=self._word(signature))

    def reduce_scatter(self, output, input, op, group=None, *, signature=None) -> None:
        comm = self._by_blocks(group)
        if comm is None:
            self._backend.reduce_scatter(output, input, op, group)
        else:
            comm.reduce_scatter(output, input, op, signature=self._word(signature))

    def reduce(self, tensor, dst, op, group=None, *, signature=None) -> None:
        comm = group_communicator(group)
        if comm is None:
            self._backend.reduce(tensor, dst, op, group)
        else:
            comm.reduce(tensor, dst, op, signature=self._word(signature))

    def supports(self, tensor, group=None) -> bool:
        return supports(tensor, group)


def supports(tensor: torch.Tensor, group=None) -> bool:
    """For algo="auto": CPU tensors of a supported dtype, every rank on this host.

    The first call per group exchanges host identities, so it must happen on every
    rank (auto-dispatch does: every rank runs the same collective)."""
    if tensor.device.type != "cpu" or tensor.dtype not in ops.DTYPES:
        return False
    if not (segment.available() and memory_model_ok()) or groups.view(group) is None:
        return False
    found = _hosts.get(group)
    if found is None:
        view = groups.view(group)
        keys: list = [None] * view.size
        dist.all_gather_object(keys, host_key(), group=group)
        found = len(set(keys)) == 1
        _hosts.set(group, found)
    return found
