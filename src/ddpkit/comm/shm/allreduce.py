"""Shared-memory all-reduce for ranks on one host: gradients reduced at memory speed.

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
all-reduce, chosen automatically from the ranks' host identities.

:mod:`ddpkit.comm.registry` registers this module as algorithm "shm" (``algo="shm"``,
and first choice of ``algo="auto"`` for CPU tensors on one host).
"""

from __future__ import annotations

import contextlib
import os
import socket
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit.comm import groups, ops
from ddpkit.comm.shm import segment
from ddpkit.comm.shm.sync import META_WORDS, Control, block_bytes, memory_model_ok
from ddpkit.errors import CommError
from ddpkit.log import get_logger

log = get_logger(__name__)

DEFAULT_SLOT_MB = 8.0  # scratch per rank for tensors that were not allocated by us
DEFAULT_TIMEOUT_S = 600.0
# Reduce-then-write-back granularity: the piece stays in L2 for the write-back. On a
# 33.6 MB in-place all-reduce, 1 MiB took 3.1 ms against 4.1 (256 KiB), 3.4 (4 MiB)
# and 3.8 (no pieces), 2 ranks here.
PIECE_BYTES = 1 << 20
# Up to this size every rank reduces the whole message itself from double-buffered
# areas: one barrier per call instead of two, which is what latency is made of.
SMALL_BYTES = 64 << 10
ALIGN_BYTES = 64  # chunk boundaries on cache lines: no two ranks write one line
HOST_ENV = "DDPKIT_HOST_ID"  # overrides the host identity (tests fake multi-host runs)
RUN_ENV = "TORCHELASTIC_RUN_ID"


def host_key() -> str:
    """Identity of the kernel this process runs on: ranks that share it share /dev/shm."""
    override = os.environ.get(HOST_ENV)
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def run_id() -> str:
    return os.environ.get(RUN_ENV) or "default"


@dataclass
class _Allocation:
    """Where one allocate() result lives. Only a weak reference to the mapping: when the
    caller drops the tensor (DataParallel rebuilding its buckets) the memory goes too."""

    mapping: weakref.ref
    region_bytes: int
    base: int  # data_ptr of this rank's region

    def regions(self, nranks: int) -> list[torch.Tensor] | None:
        mapping = self.mapping()
        if mapping is None:
            return None
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        size = self.region_bytes
        return [whole[r * size:(r + 1) * size] for r in range(nranks)]


def _chunk_bounds(numel: int, itemsize: int, parts: int) -> list[int]:
    align = max(1, ALIGN_BYTES // itemsize)
    bounds = [min(numel, (numel * i // parts) // align * align) for i in range(parts)]
    return bounds + [numel]


class ShmCommunicator:
    """All-reduce over shared memory for the ranks of ``group`` (collective to create).

    ``host_id`` overrides how ranks decide they share a host (default: hostname and
    boot id, or ``$DDPKIT_HOST_ID``). ``slot_mb`` bounds the scratch each rank copies
    private tensors through; larger tensors go through it in pieces. Every rank of the
    group must construct, :meth:`allocate` and :meth:`all_reduce` in the same order.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        host_id: str | None = None,
        slot_mb: float = DEFAULT_SLOT_MB,
        timeout: float = DEFAULT_TIMEOUT_S,
        run: str | None = None,
    ):
        if not segment.available():
            raise CommError(f"shared memory needs a writable {segment.SHM_DIR}; use algo='backend'")
        if not memory_model_ok():
            raise CommError("shm collectives need x86-64 memory ordering; use algo='backend'")
        view = groups.view(group)
        if view is None:
            raise CommError("this rank is not a member of the group it asked shm to serve")
        self.group, self.view = group, view
        self.run = run or run_id()
        self.timeout = float(timeout)
        # two page-aligned halves: consecutive pieces alternate between them
        self.slot_bytes = segment.round_up(max(int(slot_mb * 2**20), 1), 2 * segment.PAGE)
        # allocation number -> where it lives; numbers agree across ranks because every
        # rank allocates in the same order, so they can be checked in each call's meta
        self._allocs: dict[int, _Allocation] = {}
        self._allocated = 0
        self._closed = False

        hosts: dict[str, list[int]] = {}
        for group_rank, key in enumerate(self._gather(host_id or host_key())):
            hosts.setdefault(key, []).append(group_rank)
        self.nhosts = len(hosts)
        self.local = next(ranks for ranks in hosts.values() if view.rank in ranks)
        self.local_size = len(self.local)
        self.me = self.local.index(view.rank)
        self.is_leader = self.me == 0

        ctl_bytes = segment.round_up(block_bytes(self.local_size))
        small_bytes = self.local_size * 2 * SMALL_BYTES
        size = ctl_bytes + small_bytes + self.local_size * self.slot_bytes
        self._ctl_seg = self._shared("ctl", size, True)
        labels = [f"rank {view.global_rank(r)}" for r in self.local]
        self.control = Control(self._ctl_seg.buffer, self.local_size, self.me, self.timeout, labels)
        self.control.publish_pid(os.getpid())
        whole = torch.frombuffer(self._ctl_seg.buffer, dtype=torch.uint8)
        # small[parity][rank]: the area a rank fills for its even / odd small calls
        self._small = [
            [whole[ctl_bytes + (2 * r + parity) * SMALL_BYTES:][:SMALL_BYTES]
             for r in range(self.local_size)]
            for parity in (0, 1)
        ]
        self._small_calls = 0
        self._small_views: dict = {}  # (parity, numel, dtype) -> per-rank views
        self._codes: dict = {}
        slots_at = ctl_bytes + small_bytes
        self._slots = [
            whole[slots_at + r * self.slot_bytes: slots_at + (r + 1) * self.slot_bytes]
            for r in range(self.local_size)
        ]
        half = self.slot_bytes // 2
        self._halves = [[s[p * half:(p + 1) * half] for s in self._slots] for p in (0, 1)]
        self._pieces = 0
        self.control.barrier()
        # Ranks in separate pid namespaces (containers sharing /dev/shm) cannot see
        # each other's pids; then only the timeout can tell a dead peer.
        self.control.check_pids = all(
            segment.pid_alive(self.control.pid(r)) for r in self.control.peers
        )
        self.leaders = None
        if self.nhosts > 1:
            leader_ranks = [view.global_rank(ranks[0]) for ranks in hosts.values()]
            if self.is_leader:
                backend = "gloo" if dist.is_gloo_available() else None
                self.leaders = dist.new_group(
                    leader_ranks, backend=backend, use_local_synchronization=True
                )

    # ------------------------------------------------------------------ set-up

    def _gather(self, obj) -> list:
        out: list = [None] * self.view.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _shared(self, tag: str, size: int, clean: bool = False) -> segment.Segment:
        """Collectively create a segment per host: leader creates, peers attach, leader
        unlinks once everyone has attached or anything failed."""
        seg, error = None, None
        try:
            if self.is_leader:
                try:
                    if clean:
                        removed = segment.remove_stale(self.run)
                        if removed:
                            log.warning(
                                f"removed {len(removed)} stale shared-memory segment(s) of run "
                                f"{self.run!r} left by a killed process", all_ranks=True)
                    seg = segment.create(segment.new_name(self.run, tag), size)
                except OSError as exc:
                    error = self._space_error(size, exc)
            names = self._gather((seg.name if seg else None, error))
            failed = [e for _, e in names if e]
            if failed:
                raise CommError(failed[0])
            if not self.is_leader:
                try:
                    seg = segment.attach(names[self.local[0]][0], size)
                except OSError as exc:
                    error = (f"rank {self.view.global_rank(self.view.rank)} could not attach "
                             f"shared memory created by its host's leader ({exc}); ranks that "
                             f"share a host id must share {segment.SHM_DIR}")
            failed = [e for e in self._gather(error) if e]
            if failed:
                raise CommError(failed[0])
            return seg
        except BaseException:
            if seg is not None:
                seg.close()
            raise
        finally:
            if seg is not None:
                seg.unlink()

    @staticmethod
    def _space_error(size: int, exc: OSError) -> str:
        try:
            st = os.statvfs(segment.SHM_DIR)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free"
        except OSError:
            free = "free space unknown"
        return (f"cannot reserve {size / 2**20:.1f} MiB in {segment.SHM_DIR} ({free}): "
                f"{exc.strerror or exc}; enlarge it (docker: --shm-size) or use algo='backend'")

    def allocate(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A flat CPU tensor of ``numel`` elements living in shared memory (collective).

        All-reducing it (or a contiguous slice of it) skips the copy in and out. Every
        rank must allocate the same sizes in the same order.
        """
        self._check_open()
        ops.check_dtype(dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        region = segment.round_up(max(numel * itemsize, 1))
        seg = self._shared("buf", region * self.local_size)
        whole = torch.frombuffer(seg.buffer, dtype=torch.uint8)
        mine = whole[self.me * region:(self.me + 1) * region]
        self._allocs = {k: a for k, a in self._allocs.items() if a.mapping() is not None}
        self._allocs[self._allocated] = _Allocation(weakref.ref(seg.buffer), region,
                                                    mine.data_ptr())
        self._allocated += 1
        return mine[: numel * itemsize].view(dtype)

    def close(self) -> None:
        """Release this rank's mappings (memory stays until tensors from allocate() go)."""
        if self._closed:
            return
        self._closed = True
        self._allocs.clear()  # tensors from allocate() keep their memory until dropped
        self._slots.clear()
        self._halves.clear()
        self._ctl_seg.close()
        if self.leaders is not None:
            dist.destroy_process_group(self.leaders)
            self.leaders = None

    def __enter__(self) -> ShmCommunicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CommError("this ShmCommunicator is closed; create a new one")

    # ------------------------------------------------------------------ all-reduce

    def all_reduce(
        self, tensor: torch.Tensor, op: str | dist.ReduceOp = "sum", *, divisor: int | None = None
    ) -> torch.Tensor:
        """Reduce ``tensor`` in place across the group; returns it.

        ``divisor`` divides a sum by a count of your choice (DataParallel's join divides
        by the ranks still training); "avg" is a sum with ``divisor`` = group size. On one
        host the division happens inside the reduction pass, not as another pass.
        """
        self._check_open()
        name, code = self._checked(op, tensor.dtype)
        if tensor.device.type != "cpu":
            raise CommError(f"shm all_reduce needs a CPU tensor, got one on {tensor.device}")
        if name == "avg" and divisor is None:
            divisor = self.view.size
        if divisor is not None and (name not in ("sum", "avg") or not tensor.is_floating_point()):
            raise CommError(f"divisor= needs op 'sum' or 'avg' on a floating tensor, got {name!r} "
                            f"on {tensor.dtype}")
        if not tensor.is_contiguous():
            flat = tensor.contiguous().view(-1)
        else:
            flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        local_op = "sum" if name == "avg" else name
        in_pass = divisor if self.nhosts == 1 and divisor != 1 else None
        # Which path runs must be decided identically on every rank, from what all of
        # them see: a rank may hold a private tensor where its peers hold an allocated
        # one (a joined rank's stand-in gradients, say). Small messages take the small
        # path whatever their memory; larger ones are reduced in place only when every
        # rank's tensor sits at the same place of the same allocation.
        if flat.numel() * flat.element_size() <= SMALL_BYTES:
            where = None
            self._reduce_small(flat, local_op, in_pass, (flat.numel(), code, -1, -1))
        else:
            where = self._find(flat)
            meta = (flat.numel(), code, -1, -1) if where is None else (flat.numel(), code, *where)
            if not self._arrive_checked(meta):
                where = None
            if where is None:
                self._reduce_through_slots(flat, local_op, in_pass)
            else:
                self._reduce_in_place(flat, where, local_op, in_pass)
        if self.nhosts > 1:
            if self.leaders is not None and flat.numel():
                dist.all_reduce(flat, ops.TO_REDUCE_OP[local_op], group=self.leaders)
            self._broadcast_from_leader(flat, where)
            if divisor is not None and divisor != 1:
                flat.div_(divisor)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def _checked(self, op, dtype: torch.dtype) -> tuple[str, int]:
        """(op name, dtype/op code); validated once per combination (calls are hot)."""
        try:
            return self._codes[(op, dtype)]
        except (KeyError, TypeError):
            name = ops.op_name(op)
            ops.check_op(name, dtype)
            found = (name, ops.DTYPES.index(dtype) * 16 + ops.OPS.index(name))
            with contextlib.suppress(TypeError):  # an unhashable op object: not cached
                self._codes[(op, dtype)] = found
            return found

    def _find(self, flat: torch.Tensor) -> tuple[int, int] | None:
        """(allocation number, byte offset) when ``flat`` lies in memory we allocated."""
        ptr, nbytes = flat.data_ptr(), flat.numel() * flat.element_size()
        for number, alloc in self._allocs.items():
            # A dead mapping's address may have been reused: only live ones can match.
            if (alloc.base <= ptr and ptr + nbytes <= alloc.base + alloc.region_bytes
                    and alloc.mapping() is not None):
                return number, ptr - alloc.base
        return None

    def _regions(self, number: int) -> list[torch.Tensor]:
        regions = self._allocs[number].regions(self.local_size)
        assert regions is not None  # the caller holds a tensor in it
        return regions

    def _arrive_checked(self, meta: tuple[int, ...], slot: int = 2) -> bool:
        """Barrier that also proves every local rank called with the same size, dtype
        and op (a mismatch raises on every rank instead of corrupting memory). Returns
        whether all ranks' tensors are at the same place of the same allocation."""
        self.control.publish_meta(meta, slot)
        self.control.barrier()
        same_place = meta[2] >= 0
        for peer in self.control.peers:
            theirs = self.control.meta(peer, len(meta), slot)
            if theirs[:2] != meta[:2]:
                raise CommError(
                    f"ranks called shm all_reduce differently: {self._describe(meta)} here, "
                    f"{self._describe(theirs)} on {self.control.labels[peer]}"
                )
            same_place = same_place and theirs[2:] == meta[2:]
        return same_place

    @staticmethod
    def _describe(meta: tuple[int, ...]) -> str:
        numel, code = meta[:2]
        dtype, op = divmod(code, 16)
        if not 0 <= dtype < len(ops.DTYPES) or not 0 <= op < len(ops.OPS):
            return f"{numel} elements (unknown dtype/op code {code})"
        return f"{numel} x {str(ops.DTYPES[dtype]).removeprefix('torch.')} {ops.OPS[op]!r}"

    def _reduce_small(self, flat, op, divisor, meta) -> None:
        """One barrier: publish, then every rank reduces everything itself, in the same
        rank order (so results agree bit for bit). The area used alternates between
        calls: a peer may still be reading this call's data while we start the next."""
        parity = self._small_calls % 2
        self._small_calls += 1
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
            parity = self._pieces % 2
            self._pieces += 1
            slots = [h[: count * itemsize].view(flat.dtype) for h in self._halves[parity]]
            mine, piece = slots[self.me], flat[start:start + count]
            bounds = _chunk_bounds(count, itemsize, self.local_size)
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
        bounds = _chunk_bounds(regions[0].numel(), regions[0].element_size(), self.local_size)
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

    def _broadcast_from_leader(self, flat: torch.Tensor, where) -> None:
        """After the leaders' exchange, every local rank takes the leader's result."""
        if where is not None:
            start = where[1]
            stop = start + flat.numel() * flat.element_size()
            source = self._regions(where[0])[0][start:stop].view(flat.dtype)
            self.control.barrier()
            if not self.is_leader:
                flat.copy_(source)
            self.control.barrier()
            return
        numel, itemsize = flat.numel(), flat.element_size()
        step = self.slot_bytes // itemsize
        self.control.barrier()  # peers may still be copying results out of the leader's slot
        for start in range(0, numel, step):
            count = min(numel - start, step)
            source = self._slots[0][: count * itemsize].view(flat.dtype)
            if self.is_leader:
                source.copy_(flat[start:start + count])
            self.control.barrier()
            if not self.is_leader:
                flat[start:start + count].copy_(source)
            self.control.barrier()


assert META_WORDS >= 3 * 4  # three meta slots of (numel, dtype/op, buffer, offset)


# ---------------------------------------------------------------------- registry face

_communicators: dict = {}  # group -> ShmCommunicator, or None when shm proved unusable
_hosts: dict = {}  # group -> whether all its ranks share one host


def _key(group):
    return dist.group.WORLD if group is None else group


def communicator(group: dist.ProcessGroup | None = None) -> ShmCommunicator | None:
    """The shared communicator for ``group`` (created collectively on first use), or None
    when shared memory is unusable here (then the caller falls back to the backend)."""
    key = _key(group)
    if key not in _communicators:
        try:
            _communicators[key] = ShmCommunicator(group)
        except CommError as exc:
            log.warning(f"shared-memory all_reduce unavailable, using the backend: {exc}")
            _communicators[key] = None
    return _communicators[key]


def backend_all_reduce(tensor: torch.Tensor, op: str, group=None) -> torch.Tensor:
    name = ops.op_name(op)
    dist.all_reduce(tensor, ops.TO_REDUCE_OP["sum" if name == "avg" else name], group=group)
    if name == "avg":
        tensor.div_(dist.get_world_size(group))
    return tensor


def all_reduce(tensor: torch.Tensor, op: str | dist.ReduceOp = "sum", group=None) -> torch.Tensor:
    """Registry entry point: shm when usable, else the backend's own all_reduce."""
    if groups.view(group) is None:
        return tensor  # not a member: a no-op, as in torch
    comm = communicator(group)
    if comm is None:
        return backend_all_reduce(tensor, op, group)
    return comm.all_reduce(tensor, op)


def supports(tensor: torch.Tensor, group=None) -> bool:
    """For algo="auto": CPU tensors of a supported dtype, every rank on this host.

    The first call per group exchanges host identities, so it must happen on every
    rank (auto-dispatch does: every rank runs the same collective)."""
    if tensor.device.type != "cpu" or tensor.dtype not in ops.DTYPES:
        return False
    if not (segment.available() and memory_model_ok()) or groups.view(group) is None:
        return False
    key = _key(group)
    if key not in _hosts:
        view = groups.view(group)
        keys: list = [None] * view.size
        dist.all_gather_object(keys, host_key(), group=group)
        _hosts[key] = len(set(keys)) == 1
    return _hosts[key]
