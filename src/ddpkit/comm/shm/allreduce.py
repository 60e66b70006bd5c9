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
all-reduce, chosen automatically from the ranks' host identities. The other collectives
take the same shape across hosts (:mod:`ddpkit.comm.shm.hierarchical`).

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

from ddpkit import lifetime
from ddpkit.comm import groups, ops
from ddpkit.comm.backend import BackendAlgorithm
from ddpkit.comm.shm import hierarchical, segment
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


def chunk_bounds(numel: int, itemsize: int, parts: int) -> list[int]:
    """Where ``parts`` ranks split ``numel`` elements: rank i reduces [b[i], b[i+1]).
    Boundaries fall on cache lines, so no two ranks write one line."""
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
            found = (name, signature_word(collective, _dtype_name(dtype), name, root))
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
            hierarchical.broadcast(self, flat, src, code)
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
            hierarchical.all_gather(self, out, src, code)
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
            hierarchical.reduce_scatter(self, out, src, name, code)
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
            hierarchical.reduce(self, flat, dst, name, code)
            if flat.data_ptr() != tensor.data_ptr() and self._is(dst):
                tensor.copy_(flat.view_as(tensor))
            return tensor
        work = tensor if self._is(dst) else tensor.clone()
        self.all_reduce(work, name, signature=code)
        return tensor

    def _is(self, global_rank: int) -> bool:
        return self.view.global_rank(self.view.rank) == global_rank

    @staticmethod
    def _into(flat: torch.Tensor):
        """A :meth:`_send_from` sink that lands each piece at its place in ``flat``."""
        def sink(start: int, piece: torch.Tensor) -> None:
            flat[start:start + piece.numel()].copy_(piece)
        return sink


assert META_WORDS >= 2 * 4  # two meta slots of (numel, signature, buffer, offset)


# ---------------------------------------------------------------------- signature words
# A call's signature in one int64 word, published in the control block at the call's
# first barrier: bit 0 "this rank refused", then op, dtype, collective and root.

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "barrier")
_NONE = 15  # op "-" (no op), or a dtype shm cannot name


def _dtype_name(dtype) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


_DTYPE_NAMES = tuple(_dtype_name(d) for d in ops.DTYPES)


def signature_word(collective: str, dtype: str, op: str, root: int = -1,
                   problem: bool = False) -> int:
    """The word for a call; ``dtype`` and ``op`` by name ("-" when there is none)."""
    d = _DTYPE_NAMES.index(dtype) if dtype in _DTYPE_NAMES else _NONE
    o = ops.OPS.index(op) if op in ops.OPS else _NONE
    root = root if isinstance(root, int) and root >= -1 else -2
    return int(problem) | o << 1 | d << 5 | COLLECTIVES.index(collective) << 9 | (root + 2) << 13


def describe_call(numel: int, word: int) -> tuple[str, str]:
    """(collective, "numel x dtype, op=..., root=...") for a published word."""
    o, d, c, root = word >> 1 & 15, word >> 5 & 15, word >> 9 & 15, (word >> 13) - 2
    collective = COLLECTIVES[c] if c < len(COLLECTIVES) else f"<collective {c}>"
    parts = [f"{numel} x {_DTYPE_NAMES[d] if d < len(_DTYPE_NAMES) else 'other dtype'}"]
    if o < len(ops.OPS):
        parts.append(f"op={ops.OPS[o]}")
    if root >= 0:
        parts.append(f"root={root}")
    if collective != "all_reduce":
        parts.insert(0, collective)
    return collective, ", ".join(parts)


# ---------------------------------------------------------------------- registry face

# group -> ShmCommunicator, or None when shm proved unusable; a communicator is closed
# when its group dies (ddpkit.lifetime)
_communicators = lifetime.PerGroup(on_drop=ShmCommunicator.close)
_hosts = lifetime.PerGroup()  # group -> whether all its ranks share one host


def communicator(group: dist.ProcessGroup | None = None) -> ShmCommunicator | None:
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


def all_reduce(tensor: torch.Tensor, op: str | dist.ReduceOp = "sum", group=None) -> torch.Tensor:
    """Shm when usable, else the backend's own all_reduce (no in-band check of the
    public layer's signature: use ``ddpkit.comm.all_reduce`` for that)."""
    if groups.view(group) is None:
        return tensor  # not a member: a no-op, as in torch
    comm = communicator(group)
    if comm is None:
        return backend_all_reduce(tensor, op, group)
    return comm.all_reduce(tensor, op)


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
        comm = communicator(group)
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
        comm = communicator(group)
        return comm if comm is not None and comm.nhosts == 1 else None

    def _by_blocks(self, group) -> ShmCommunicator | None:
        """The communicator where it can gather and scatter by group rank (one host, or
        hosts holding equal blocks of consecutive ranks), else None: the backend."""
        comm = communicator(group)
        return comm if comm is not None and comm.host_blocks else None

    def refuse(self, signature, group=None) -> None:
        """This rank refused the call locally: tell the peers at the call's barrier."""
        comm = self._one_host(group)
        if comm is not None:
            comm.refuse(self._word(signature), max(signature.numel_in, 0))

    def all_reduce(self, tensor, op, group=None, *, signature=None) -> None:
        comm = communicator(group)
        if comm is None:
            self._backend.all_reduce(tensor, op, group)
        else:
            comm.all_reduce(tensor, op, signature=self._word(signature))

    def direct_all_reduce(self, op, group=None, *, signature=None):
        """``all_reduce(flat, op)`` with ``signature`` checked in-band, bound now to the
        group's communicator (the public layer remembers it for repeated calls), or None
        where the call is not in-band."""
        comm = self._one_host(group)
        if comm is None:
            return None
        word = self._word(signature)
        return lambda flat: comm.all_reduce(flat, op, signature=word)

    def barrier(self, group=None, *, signature=None) -> None:
        comm = communicator(group)
        if comm is None:
            dist.barrier(group=group)
        else:
            comm.barrier(signature=self._word(signature))

    def broadcast(self, tensor, src, group=None, *, signature=None) -> None:
        comm = communicator(group)
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
        comm = communicator(group)
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
