"""How DataParallel's default path moves a bucket: ``comm="auto" | "backend" | "ring" | "shm"``.

A transport owns two things of the engine's default (no comm hook) path:

* ``allocate(numel, dtype, device)``: the storage of each flat gradient bucket, which
  ``param.grad`` views into;
* ``all_reduce(buffer)``: sum one bucket (already scaled by ``1/divisor`` while the
  gradients were copied in) across the group, returning a handle with ``wait()`` or
  None when the sum is complete on return.

It also carries the engine's other per-step traffic, so that a transport that avoids
the backend avoids it for the whole step: ``broadcast(tensors, src)`` (the buffers
before each forward, the bucket order at the rebuild, the final state after a join) and
``sum_(tensor)`` (small integer vectors, blocking: the ``find_unused_parameters`` flags
and join's per-forward "who still trains"). The backend transports make exactly the
torch.distributed calls the engine always made; ``"shm"`` makes none on one host. Each
transport here implements :class:`ddpkit.parallel.engine.interfaces.Transport`, and
:class:`~ddpkit.parallel.engine.interfaces.ShardingTransport` for ZeRO-2 and 3
(``reduce_own_chunk``, ``all_gather_chunks``).

``"auto"`` (the default) is decided once per engine, from the devices of the module's
parameters and the group's layout (:func:`ddpkit.comm.auto.algo_for`): CPU ranks that
share a host get ``"shm"``; anything on an accelerator (CUDA -> NCCL), a group of one
rank, ranks one per host or a rank without usable shared memory get ``"backend"``.

``"shm"`` places every CPU bucket in a shared-memory segment of the host
(:meth:`ddpkit.comm.shm.ShmCommunicator.allocate`), so backward's copy of a gradient
into its bucket is also its hand-over to the peers, and the all-reduce runs in place:
each rank sums its 1/L share of the bucket across the ranks' regions and writes it back
to all of them, with no copy in or out and no socket. Each element is summed by exactly
one rank, so replicas stay bit-identical. Across hosts the same communicator reduces
inside each host and between one leader per host over the backend.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit.comm import all_reduce as comm_all_reduce
from ddpkit.comm import auto
from ddpkit.comm.shm import ShmCommunicator
from ddpkit.errors import CommError, ConfigError
from ddpkit.log import get_logger
from ddpkit.parallel.engine.buckets import default_allocator
from ddpkit.parallel.engine.state_sync import BytePacker, broadcast_coalesced, broadcast_packed
from ddpkit.vocabulary import COMM_CHOICES

log = get_logger(__name__)

# Scratch per rank for buckets that are not in the segment (a joined rank's stand-in
# zeros, a bucket whose allocation failed): they go through it in pieces.
SHM_SLOT_MB = 2.0


def choose(comm: str, device_types: Sequence[str], world_size: int, *,
           same_host: bool = True, shm_ok: bool = True, max_local: int | None = None) -> str:
    """The transport ``comm`` means for these parameter devices and group layout (pure).

    ``"auto"`` follows :func:`ddpkit.comm.auto.choose_algo` for the parameters' device:
    buckets on an accelerator (or spread over several device types) always get
    ``"backend"``; CPU buckets get ``"shm"`` where ``choose_algo`` says shm or
    hierarchical (the shm communicator is hierarchical across hosts).
    """
    if comm not in COMM_CHOICES:
        raise ConfigError(f"comm must be one of {', '.join(COMM_CHOICES)} or a comm hook, "
                          f"got {comm!r}")
    if comm != "auto":
        return comm
    types = set(device_types)
    device_type = types.pop() if len(types) == 1 else "mixed"
    algo = auto.choose_algo(device_type, same_host, world_size, shm_ok=shm_ok,
                            max_local=max_local)
    return "shm" if algo in ("shm", "hierarchical") else "backend"


def resolve_comm(comm: str, device_types: Sequence[str], group) -> str:
    """:func:`choose` for a live group. Only a CPU module's ``"auto"`` exchanges anything
    (the group's host layout, once per group: every rank calls this in the constructor);
    explicit choices and accelerator modules decide without communication."""
    types = set(device_types)
    if comm != "auto" or types != {"cpu"}:
        return choose(comm, device_types, dist.get_world_size(group))
    lay = auto.layout(group)
    return choose(comm, device_types, lay.world_size, same_host=lay.same_host,
                  shm_ok=lay.shm_ok, max_local=lay.max_local)


def group_timeout(group) -> float | None:
    """The process group's collective timeout in seconds (None when torch hides it)."""
    pg = group if group is not None else dist.group.WORLD
    get_backend = getattr(pg, "_get_backend", None)
    if get_backend is None:
        return None
    try:
        backend = get_backend(torch.device("cpu"))
    except RuntimeError:  # no CPU backend on this group (NCCL only)
        return None
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) else None


def all_gather_chunks_padded(flat: torch.Tensor, bounds: Sequence[int], group) -> None:
    """The backend's uneven in-place all-gather: chunks padded to the longest one."""
    ranks = len(bounds) - 1
    sizes = [bounds[r + 1] - bounds[r] for r in range(ranks)]
    longest = max(sizes)
    if longest == 0:
        return
    me = dist.get_rank(group)
    mine = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
    mine[:sizes[me]].copy_(flat[bounds[me]:bounds[me + 1]])
    gathered = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(gathered, mine, group=group)
    for r in range(ranks):
        if r != me:
            flat[bounds[r]:bounds[r + 1]].copy_(gathered[r][:sizes[r]])


class BackendTransport:
    """torch's all_reduce on the group's backend (gloo, NCCL): private bucket memory."""

    name = "backend"
    reduces_inline = False  # all_reduce returns a handle; the sum overlaps backward

    def __init__(self, group):
        self.group = group

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return default_allocator(numel, dtype, device)

    def all_reduce(self, buffer: torch.Tensor):
        return dist.all_reduce(buffer, group=self.group, async_op=True)

    def reduce_own_chunk(self, buffer: torch.Tensor):
        """ZeRO-2 and 3's bucket collective: leave at least this rank's chunk of
        ``buffer`` (:func:`ddpkit.comm.chunk_bounds`) summed across the group, with the
        bits the unsharded engine's all-reduce gives it; the rest of ``buffer`` is not
        to be read. Here that is the same all-reduce of the whole bucket, not torch's
        reduce-scatter: that one takes equal blocks (the chunks are cut on cache lines),
        and nothing promises it adds in the order its all-reduce does."""
        return self.all_reduce(buffer)

    def all_gather_chunks(self, flat: torch.Tensor, bounds: Sequence[int]) -> None:
        """Every rank gets group rank r's ``flat[bounds[r]:bounds[r + 1]]`` (in place)."""
        all_gather_chunks_padded(flat, bounds, self.group)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int, *,
                  every_step: bool = False) -> None:
        """Overwrite ``tensors`` with group rank ``src``'s values (coalesced per dtype)."""
        broadcast_coalesced(tensors, src, self.group)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor across the group, in place, before returning."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def close(self) -> None:
        pass


class RingTransport(BackendTransport):
    """ddpkit's segmented ring (``ddpkit.comm.all_reduce(algo="ring")``), asynchronous."""

    name = "ring"

    def all_reduce(self, buffer: torch.Tensor):
        return comm_all_reduce(buffer, op="sum", algo="ring", group=self.group, async_op=True)


class ShmTransport:
    """Buckets in the host's shared segment, summed in place there (see module docstring).

    Created collectively by the engine's constructor, with the group's timeout. Buckets
    on another device than the CPU stay private and use the backend.
    """

    name = "shm"
    # all_reduce of a CPU bucket runs on the calling thread and is complete on return
    # (the reducer then launches every bucket at the end of backward, see BucketReducer).
    reduces_inline = True

    def __init__(self, group, *, slot_mb: float = SHM_SLOT_MB):
        timeout = group_timeout(group)
        options = {"slot_mb": slot_mb} | ({} if timeout is None else {"timeout": timeout})
        self.group = group
        self.comm = ShmCommunicator(group, **options)
        self._private_failed = False
        self._shared: list[weakref.ref] = []  # bucket buffers placed in the segment
        self._packers: dict[tuple[int, ...], BytePacker] = {}  # broadcast lists -> packing
        self._rank = dist.get_rank(group)
        self._global = dist.get_process_group_ranks(group or dist.group.WORLD)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in a bucket buffer this transport placed in
        shared memory."""
        start = tensor.data_ptr()
        stop = start + tensor.numel() * tensor.element_size()
        self._shared = [ref for ref in self._shared if ref() is not None]
        for ref in self._shared:
            buf = ref()
            if buf is not None and buf.data_ptr() <= start and (
                    stop <= buf.data_ptr() + buf.numel() * buf.element_size()):
                return True
        return False

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return default_allocator(numel, dtype, device)
        try:
            buffer = self.comm.allocate(numel, dtype)
        except CommError as exc:  # raised on every rank together: all keep it private
            if not self._private_failed:
                log.warning(f"DataParallel comm='shm': a bucket of {numel} elements stays in "
                            f"private memory and is copied through the shared slots ({exc})")
                self._private_failed = True
            return default_allocator(numel, dtype, device)
        self._shared.append(weakref.ref(buffer))
        return buffer

    def all_reduce(self, buffer: torch.Tensor):
        if buffer.device.type != "cpu":
            return dist.all_reduce(buffer, group=self.group, async_op=True)
        self.comm.all_reduce(buffer, "sum")
        return None

    def reduce_own_chunk(self, buffer: torch.Tensor):
        """On one host a real reduce-scatter: only this rank's chunk of a private
        bucket is summed (the chunk the in-place all-reduce sums, added in the same
        order); across hosts, and off the CPU, the whole bucket's all-reduce."""
        if buffer.device.type != "cpu":
            return dist.all_reduce(buffer, group=self.group, async_op=True)
        if self.comm.nhosts > 1:
            self.comm.all_reduce(buffer, "sum")
        else:
            self.comm.reduce_scatter_chunks(buffer)
        return None

    def all_gather_chunks(self, flat: torch.Tensor, bounds: Sequence[int]) -> None:
        if self.comm.nhosts > 1 or flat.device.type != "cpu":
            all_gather_chunks_padded(flat, bounds, self.group)
        else:
            self.comm.all_gather_chunks(flat, list(bounds))

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int, *,
                  every_step: bool = False) -> None:
        """CPU tensors of any dtypes travel as bytes through the segment (on one host;
        across hosts, and for other devices, the backend's broadcast). A list sent
        ``every_step`` (the buffers before each forward) is packed into one message
        whose layout is planned once; other lists go tensor by tensor, with no second
        copy of a whole model in memory."""
        if not tensors:
            return
        if self.comm.nhosts > 1 or any(t.device.type != "cpu" for t in tensors):
            broadcast_coalesced(tensors, src, self.group)
            return
        root = self._global[src]
        if not every_step:
            with torch.no_grad():
                for t in tensors:
                    flat = t.detach().contiguous().view(-1).view(torch.uint8)
                    self.comm.broadcast(flat, root)
                    if flat.data_ptr() != t.data_ptr() and src != self._rank:
                        t.copy_(flat.view(t.dtype).view(t.shape))
            return
        key = tuple(id(t) for t in tensors)
        packer = self._packers.get(key)
        if packer is None or any(a is not b for a, b in zip(packer.tensors, tensors)) or any(
                v.shape != t.shape or v.dtype != t.dtype
                for v, t in zip(packer.views, tensors)):
            if len(self._packers) > 16:
                self._packers.clear()
            packer = self._packers[key] = BytePacker(tensors)
        broadcast_packed(packer, src, src == self._rank,
                         lambda flat, _: self.comm.broadcast(flat, root))

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.reduce_(tensor, "sum")

    def reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce ``tensor`` across the group with ``op`` ("sum", "max", ...), in place,
        complete on return: through the segment for a CPU tensor, else the backend."""
        if tensor.device.type != "cpu":
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=self.group)
            return tensor
        return self.comm.all_reduce(tensor, op)

    def close(self) -> None:
        self.comm.close()


def make(choice: str, group) -> BackendTransport | RingTransport | ShmTransport:
    """The transport for a resolved choice (collective for ``"shm"``)."""
    if choice == "auto" or choice not in COMM_CHOICES:
        raise ConfigError(f"comm must be one of {', '.join(COMM_CHOICES)} or a comm hook, "
                          f"got {choice!r}")
    return COMM_CHOICES.resolve(choice)(group)


def build(comm: str, device_types: Sequence[str], group):
    """Resolve ``comm`` and create its transport. ``"auto"`` falls back to the backend
    (with one warning) where the shared segment cannot be set up; every rank learns that
    at the same collective, so all fall back together. An explicit ``"shm"`` that cannot
    work is a one-line error on every rank."""
    choice = resolve_comm(comm, device_types, group)
    if choice == "shm" and comm == "shm":
        lay = auto.layout(group)
        if not lay.shm_ok:
            raise ConfigError("comm='shm' needs shared memory (a writable /dev/shm, x86-64) "
                              "on every rank; use comm='auto' or 'backend'")
    if choice != "shm":
        return make(choice, group)
    try:
        return make(choice, group)
    except CommError as exc:
        if comm == "shm":
            raise ConfigError(f"comm='shm': {exc}") from None
        log.warning(f"DataParallel: shared memory unavailable ({exc}); reducing gradients "
                    "with the backend")
        return make("backend", group)
