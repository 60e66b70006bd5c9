"""Sum private CPU tensors across one host's ranks, in place, reading peers' memory directly.

What DataParallel's default path uses on one host when the kernel lets ranks read each
other (:mod:`ddpkit.comm.shm.peer_read`): gradients stay where autograd put them, and no
rank copies them into shared memory first. Measured on the 2-core box, that copy alone
took about a tenth of an 8.4M-parameter MLP's step (benchmarks/RESULTS.md).

One call sees its tensors (the same shapes on every rank) as one vector of N elements,
cut into L chunks (L ranks on the host); local rank i owns chunk i:

1. every rank publishes its tensors' addresses in its table (in the shared segment) and
   meets the others at a barrier that carries the call's signature, as every shm call's
   first barrier does (a mismatch raises the same CommError everywhere);
2. rank i walks its chunk in cache-sized pieces: it reads each peer's piece into a
   scratch buffer, scales every addend by ``scale`` (the 1/divisor of DDP's average,
   applied to each addend as torch's reducer does, so two ranks give torch's bits), sums
   them in rank order into its own tensors; barrier;
3. rank i reads every other chunk j from rank j's tensors (final now) straight into its
   own; barrier, after which no peer reads this rank's tensors any more.

Nothing is read while it is written: in step 2 rank i writes only chunk i of its own
tensors, which no peer reads until step 3; in step 3 it writes the other chunks of its
own tensors, which no peer reads at all. Each element is summed by one rank and copied
bit for bit, so replicas stay identical.
"""

from __future__ import annotations

import os
from bisect import bisect_right

import torch

from ddpkit.comm.shm import peer_read
from ddpkit.comm.shm.allreduce import (
    PIECE_BYTES,
    ShmCommunicator,
    _chunk_bounds,
    _dtype_name,
    signature_word,
)
from ddpkit.errors import CommError
from ddpkit.log import get_logger

log = get_logger(__name__)

HEAD = 4  # table words before the addresses: probe address, probe token, probe verdict
PROBE_ADDR, PROBE_TOKEN, PROBE_OK = 0, 1, 2


class PeerSum:
    """In-place sums of up to ``capacity`` private tensors per call (collective to create).

    ``usable`` says whether every pair of the host's ranks could read each other at
    creation (the same answer on every rank); when False, callers use another path.
    """

    def __init__(self, comm: ShmCommunicator, capacity: int):
        self.comm = comm
        self.capacity = max(int(capacity), 1)
        self.usable = False
        self._scratch: dict = {}
        if comm.nhosts != 1 or comm.local_size < 2:
            return  # across hosts the hierarchical bucket path runs; alone, nothing to sum
        table = comm.allocate(HEAD + 2 * self.capacity, torch.int64)
        number, offset = comm._find(table)
        nbytes = table.numel() * table.element_size()
        self._table = table  # keeps the allocation (and every rank's view of it) alive
        self.tables = [r[offset:offset + nbytes].view(torch.int64)
                       for r in comm._regions(number)]
        self.pids = [comm.control.pid(r) for r in range(comm.local_size)]
        self.usable = self._probe()

    def _probe(self) -> bool:
        """Every rank reads a random word from every peer; usable only if all succeed."""
        comm, mine = self.comm, self.tables[self.comm.me]
        token = int.from_bytes(os.urandom(7), "little")
        probe = torch.tensor([token], dtype=torch.int64)
        mine[PROBE_ADDR], mine[PROBE_TOKEN] = probe.data_ptr(), token
        comm.control.barrier()
        ok = peer_read.enabled()
        got = torch.zeros(1, dtype=torch.int64)
        for peer in comm.control.peers if ok else ():
            theirs = self.tables[peer]
            try:
                peer_read.read(self.pids[peer], [(got.data_ptr(), 8)],
                               [(int(theirs[PROBE_ADDR]), 8)])
            except OSError as exc:
                log.debug(f"peer reads refused ({exc}); gradients go through the shared segment")
                ok = False
                break
            ok = int(got[0]) == int(theirs[PROBE_TOKEN])
            if not ok:
                break
        mine[PROBE_OK] = 1 if ok else 2
        comm.control.barrier()  # every read of `probe` is done; verdicts are published
        return all(int(t[PROBE_OK]) == 1 for t in self.tables)

    def _buffers(self, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Per local rank a scratch piece (this rank's: its gathered own piece), plus one
        accumulator: reused every call, small enough to stay in cache."""
        bufs = self._scratch.get(dtype)
        if bufs is None:
            bufs = self._scratch[dtype] = [torch.empty(numel, dtype=dtype)
                                           for _ in range(self.comm.local_size + 1)]
        return bufs

    def sum_(self, tensors: list[torch.Tensor], scale: float | None = None) -> None:
        """Sum each tensor across the host's ranks in place (every addend multiplied by
        ``scale`` first when given). Tensors must be contiguous CPU tensors, the same
        shapes and dtypes in the same order on every rank."""
        if not self.usable:
            raise CommError("peer reads are not usable on this host; use the bucket path")
        if len(tensors) > self.capacity:
            raise CommError(f"PeerSum was built for {self.capacity} tensors, got {len(tensors)}")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise CommError("PeerSum needs contiguous CPU tensors")
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, group in by_dtype.items():
            try:
                self._sum_group(group, dtype, scale)
            except OSError as exc:  # a peer's memory went away: it died mid-call
                raise CommError(f"reading a peer's tensors failed ({exc}); a rank of this "
                                "host exited during the sum: restart the job") from exc

    def _sum_group(self, tensors: list[torch.Tensor], dtype: torch.dtype, scale) -> None:
        comm, me, size = self.comm, self.comm.me, self.comm.local_size
        flats = [t.view(-1) for t in tensors]
        numels = [f.numel() for f in flats]
        starts = [0]
        for n in numels:
            starts.append(starts[-1] + n)
        total, itemsize = starts[-1], flats[0].element_size() if flats else 1
        count = len(flats)
        row = [0] * (2 * count)
        row[0::2] = [f.data_ptr() for f in flats]
        row[1::2] = numels
        self.tables[me][HEAD:HEAD + 2 * count] = torch.tensor(row, dtype=torch.int64)
        code = signature_word("all_reduce", _dtype_name(dtype), "sum")
        comm._arrive_checked((total, code, -1, -1), comm._next_call())
        addrs = []
        for r in range(size):
            words = row if r == me else self.tables[r][HEAD:HEAD + 2 * count].tolist()
            if words[1::2] != numels:
                # every rank compares every table with its own: if any two differ, each
                # rank differs from at least one other, so all of them raise here
                raise CommError("DataParallel: gradient sizes differ across ranks; every rank "
                                "must wrap the same model")
            addrs.append(words[0::2])
        bounds = _chunk_bounds(total, itemsize, size)

        def spans(a: int, b: int) -> list[tuple[int, int, int]]:
            """(tensor, first element, count) covering elements [a, b) of the vector."""
            out, k = [], bisect_right(starts, a) - 1
            while a < b:
                while starts[k + 1] <= a:
                    k += 1
                stop = min(b, starts[k + 1])
                out.append((k, a - starts[k], stop - a))
                a = stop
            return out

        lo, hi = bounds[me], bounds[me + 1]
        piece = max(1, PIECE_BYTES // itemsize)
        bufs = self._buffers(dtype, piece)
        for a in range(lo, hi, piece):
            b = min(hi, a + piece)
            m, segs = b - a, spans(a, b)
            parts = []
            for r in range(size):
                if r == me:
                    if len(segs) == 1:
                        k, off, n = segs[0]
                        own = flats[k][off:off + n]
                    else:
                        own = torch.cat([flats[k][off:off + n] for k, off, n in segs],
                                        out=bufs[me][:m])
                    parts.append(own)
                    continue
                peer_read.read(self.pids[r], [(bufs[r].data_ptr(), m * itemsize)],
                               [(addrs[r][k] + off * itemsize, n * itemsize)
                                for k, off, n in segs])
                parts.append(bufs[r][:m])
            if scale is not None:
                for p in parts:
                    p.mul_(scale)
            if size == 2 or me == 0:
                # x + y == y + x bit for bit, so with two ranks the order is immaterial
                for r, p in enumerate(parts):
                    if r != me:
                        own.add_(p)
            else:
                acc = torch.add(parts[0], parts[1], out=bufs[size][:m])
                for p in parts[2:]:
                    acc.add_(p)
                own.copy_(acc)
            if len(segs) > 1:
                at = 0
                for k, off, n in segs:
                    flats[k][off:off + n].copy_(own[at:at + n])
                    at += n
        comm.control.barrier()
        for r in comm.control.peers:
            segs = spans(bounds[r], bounds[r + 1])
            peer_read.read(self.pids[r],
                           [(flats[k].data_ptr() + off * itemsize, n * itemsize)
                            for k, off, n in segs],
                           [(addrs[r][k] + off * itemsize, n * itemsize) for k, off, n in segs])
        comm.control.barrier()
