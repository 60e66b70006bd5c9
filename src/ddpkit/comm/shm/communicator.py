"""The shared-memory communicator: one host's ranks mapping one segment.

:class:`ShmCommunicator` is built collectively by the ranks of a group. They exchange
host identities (:func:`host_key`), so the ranks of each host find each other; each
host's leader creates a segment the host's ranks map (:mod:`ddpkit.comm.shm.segment`)
holding a control block for barriers (:mod:`ddpkit.comm.shm.sync`), double-buffered
areas for small messages and one scratch slot per rank. :meth:`ShmCommunicator.allocate`
places tensors in shared memory of their own, so collectives on them copy nothing in.

Every call is checked at its first barrier: each rank publishes a signature word
(:mod:`ddpkit.comm.shm.signature`) and a call whose ranks disagree raises the same
error everywhere. The collectives themselves are in :mod:`ddpkit.comm.shm.shm_collectives`.
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
from ddpkit.comm.ops import dtype_label
from ddpkit.comm.shm import hierarchical, segment
from ddpkit.comm.shm.shm_collectives import SMALL_BYTES, ShmCollectives
from ddpkit.comm.shm.signature import describe_call, signature_word
from ddpkit.comm.shm.sync import META_WORDS, Control, block_bytes, memory_model_ok
from ddpkit.errors import CommError
from ddpkit.log import get_logger

log = get_logger(__name__)

DEFAULT_SLOT_MB = 8.0  # scratch per rank for tensors that were not allocated by us
DEFAULT_TIMEOUT_S = 600.0
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



class ShmCommunicator(ShmCollectives):
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
        self.view = view  # holds the group weakly: a communicator keeps no group alive
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
        # every host's group ranks, hosts in the order of their first rank (the same list
        # on every rank, so every decision taken from it is taken alike everywhere)
        self.hosts = list(hosts.values())
        self.host = self.hosts.index(self.local)
        self.host_blocks = hierarchical.host_blocks(self.hosts, view)

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
        self._calls = 0  # every call on this communicator, in step on every rank
        self._small_views: dict = {}  # (parity, numel, dtype) -> per-rank views
        self._codes: dict = {}
        slots_at = ctl_bytes + small_bytes
        self._slots = [
            whole[slots_at + r * self.slot_bytes: slots_at + (r + 1) * self.slot_bytes]
            for r in range(self.local_size)
        ]
        half = self.slot_bytes // 2
        self._halves = [[s[p * half:(p + 1) * half] for s in self._slots] for p in (0, 1)]
        self._pieces = 0  # slot-half rotation (reset on every rank after a refused call)
        self.control.barrier()
        # Ranks in separate pid namespaces (containers sharing /dev/shm) cannot see
        # each other's pids; then only the timeout can tell a dead peer.
        self.control.check_pids = all(
            segment.pid_alive(self.control.pid(r)) for r in self.control.peers
        )
        self.leaders = None
        if self.nhosts > 1:
            self.leaders = hierarchical.leaders_group(view, hosts, self.is_leader)

    # ------------------------------------------------------------------ set-up

    def _gather(self, obj) -> list:
        out: list = [None] * self.view.size
        dist.all_gather_object(out, obj, group=self.view.group)
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

    def peer_views(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every local rank's counterpart of ``tensor`` (a contiguous piece of an
        :meth:`allocate` result): the same bytes of each rank's region, in local rank
        order, to be read directly (ordered by :meth:`barrier`); None when ``tensor`` is
        not in an allocation, or the group spans hosts. Not collective."""
        if self.nhosts > 1 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        flat = tensor.view(-1)
        where = self._find(flat)
        if where is None:
            return None
        number, offset = where
        nbytes = flat.numel() * flat.element_size()
        return [r[offset:offset + nbytes].view(tensor.dtype) for r in self._regions(number)]

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
            if dist.is_initialized() and self.leaders in dist.distributed_c10d._world.pg_map:
                with contextlib.suppress(ValueError, RuntimeError):
                    dist.destroy_process_group(self.leaders)
            self.leaders = None

    def __enter__(self) -> ShmCommunicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CommError("this ShmCommunicator is closed; create a new one")

    # ------------------------------------------------------------------ call signatures

    def _next_call(self) -> int:
        """This call's parity: its meta slot and small area. Consecutive calls alternate,
        since a peer may still read the previous call's after the barrier we passed."""
        parity = self._calls % 2
        self._calls += 1
        return parity

    def _next_half(self) -> int:
        parity = self._pieces % 2
        self._pieces += 1
        return parity

    def _code(self, collective: str, op, dtype: torch.dtype, root: int = -1) -> tuple[str, int]:
        """(op name, signature word) for a well-formed call; validated once per combination."""
        key = (collective, op, dtype, root)
        try:
            return self._codes[key]
        except (KeyError, TypeError):
            if collective in ("broadcast", "all_gather", "barrier"):
                name = "-"
                if collective != "barrier":
                    ops.check_dtype(dtype)
            else:
                name = ops.op_name(op)
                ops.check_op(name, dtype)
            found = (name, signature_word(collective, dtype_label(dtype), name, root))
            with contextlib.suppress(TypeError):  # an unhashable op object: not cached
                self._codes[key] = found
            return found

    def _arrive_checked(self, meta: tuple[int, ...], parity: int) -> bool:
        """Barrier that also proves every local rank made the same call (collective,
        size, dtype, op, root) and none refused it: anything else raises the same
        CommError on every rank instead of corrupting memory or hanging. Returns whether
        all ranks' tensors are at the same place of the same allocation."""
        self.control.publish_meta(meta, parity)
        self.control.barrier()
        same_place = meta[2] >= 0
        for peer in self.control.peers:
            theirs = self.control.meta(peer, len(meta), parity)
            if theirs[:2] != meta[:2] or meta[1] & 1:
                self._disagreed(meta, parity)
            same_place = same_place and theirs[2:] == meta[2:]
        return same_place

    def _disagreed(self, meta: tuple[int, ...], parity: int) -> None:
        """Every rank lands here at the same barrier; raise the message all of them build
        from the same published words (a refusing rank returns to raise its own)."""
        self._pieces = 0  # nobody read a slot this call: every rank restarts the rotation
        rows = [self.control.meta(r, len(meta), parity) for r in range(self.local_size)]
        if meta[1] & 1:
            return
        described = [describe_call(row[0], row[1]) for row in rows]
        collective = described[self.me][0]
        refused = [self.control.labels[r] for r, row in enumerate(rows) if row[1] & 1]
        if refused:
            raise CommError(
                f"{collective}: {', '.join(refused)} refused the call (see their error); "
                "every rank of the group must pass arguments the call accepts")
        lines = "; ".join(f"{self.control.labels[r]}: {text}"
                          for r, (_, text) in enumerate(described))
        raise CommError(
            f"{collective} arguments differ across ranks ({lines}); every rank of the group "
            "must make the same call with the same size, dtype, op and root")

    def refuse(self, signature: int, numel: int = 0) -> None:
        """Take part in a call this rank refused locally: peers learn it at the call's own
        barrier and raise; the caller then raises its own, more specific, error."""
        self._check_open()
        self._single_host("refuse")
        parity = self._next_call()
        self._arrive_checked((max(numel, 0), signature | 1, -1, -1), parity)

    def _single_host(self, what: str) -> None:
        if self.nhosts > 1:
            raise CommError(f"shm {what} runs on one host; this group spans {self.nhosts} "
                            "(use algo='hierarchical' or 'backend')")

    @staticmethod
    def _flat(tensor: torch.Tensor, what: str = "tensor") -> torch.Tensor:
        if tensor.device.type != "cpu":
            raise CommError(f"shm collectives need CPU tensors, got {what} on {tensor.device}")
        if not tensor.is_contiguous():
            return tensor.contiguous().view(-1)
        return tensor if tensor.dim() == 1 else tensor.view(-1)

    def _local_of(self, global_rank: int, what: str) -> int:
        return self.local.index(self.view.group_rank_of(global_rank, what))

    def _area(self, parity: int, rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` elements of ``rank``'s slot half ``parity``."""
        size = torch.empty((), dtype=dtype).element_size()
        return self._halves[parity][rank][: count * size].view(dtype)

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

    def _is(self, global_rank: int) -> bool:
        return self.view.global_rank(self.view.rank) == global_rank

assert META_WORDS >= 2 * 4  # two meta slots of (numel, signature, buffer, offset)
