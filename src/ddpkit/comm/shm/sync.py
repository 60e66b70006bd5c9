"""Barriers over a shared control block: one counter per rank, no atomics, no locks.

Each rank owns one 128-byte line of the block (two cache lines, so the adjacent-line
prefetcher does not make neighbours share) and is the only writer of it. A barrier is
"bump my counter to g, wait until every peer's counter is >= g": counters only grow,
so consecutive barriers cannot be confused and no sense reversal is needed.

Why plain stores suffice: on x86-64 (TSO) stores become visible in program order and
loads are not reordered with older loads, so a peer that sees my counter at g also
sees every byte I wrote before bumping it. Weaker memory models (ARM, POWER) would need
fences that Python cannot issue, so :func:`memory_model_ok` keeps shm off there.

Waiting spins briefly (a barrier between ranks that arrive together costs
microseconds), then yields the core, then sleeps with growing pauses: on a machine with
more ranks than cores, a spinning rank would otherwise steal the time its late peer
needs to arrive. How long it spins adapts: a wait in which yielding the core let
another process run (the peer, or whoever keeps the peer from a core) shortens the next
spin to a few microseconds, since spinning there only delays the peer; a wait whose
yields came straight back (the core was not wanted) lengthens it again, up to SPIN_S.
A dead peer is noticed by its pid, a stuck one by the timeout.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

from ddpkit.comm.shm.segment import pid_alive
from ddpkit.errors import CommError

LINE_WORDS = 16  # int64 words per rank line (128 bytes)
SEQ, PID = 0, 1
META = 2  # first of the words a rank publishes to check that peers called alike
META_WORDS = LINE_WORDS - META

SPIN_S = 50e-6  # pure spinning at most: about the cost of two context switches
MIN_SPIN_S = 2e-6  # and at least, after waits in which another process needed the core
# a sched_yield that took longer than this ran another process meanwhile (one that
# returns at once is a system call, a fraction of this)
YIELDED_S = 5e-6
YIELD_S = 2e-3  # then sched_yield for a while
# then sleeps doubling up to this: a waiter oversleeps its peer's arrival by up to one
# pause, so the cap bounds that loss, at the price of one wake-up per pause while a peer
# is long late (each a check of a word in shared memory: little of a core)
MAX_SLEEP_S = 2e-4
LIVENESS_EVERY_S = 0.2


def memory_model_ok() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def block_bytes(nranks: int) -> int:
    return nranks * LINE_WORDS * 8


class Control:
    """This rank's handle on the control block of ``nranks`` local ranks."""

    def __init__(self, buffer, nranks: int, me: int, timeout: float, labels: list[str]):
        self.words = np.frombuffer(buffer, dtype=np.int64, count=nranks * LINE_WORDS)
        # the same words as a memoryview: reading or writing one int64 through it costs a
        # fraction of numpy's scalar indexing, which is what a barrier is made of
        self.cells = memoryview(buffer)[:nranks * LINE_WORDS * 8].cast("q")
        self.nranks = nranks
        self.me = me
        self.timeout = timeout
        self.labels = labels  # how errors name each local rank, e.g. "rank 3"
        self.gen = int(self.words[me * LINE_WORDS + SEQ])
        self.peers = [r for r in range(nranks) if r != me]
        self.check_pids = True
        self.spin_s = SPIN_S  # how long the next wait spins before yielding

    def publish_pid(self, pid: int) -> None:
        self.words[self.me * LINE_WORDS + PID] = pid

    def pid(self, rank: int) -> int:
        return int(self.words[rank * LINE_WORDS + PID])

    @staticmethod
    def meta_index(rank: int, count: int, slot: int) -> int:
        """Where ``rank``'s meta slot ``slot`` of ``count`` words starts in :attr:`cells`."""
        return rank * LINE_WORDS + META + slot * count

    def publish_meta(self, values: tuple[int, ...], slot: int) -> None:
        """Publish ``values`` in meta slot ``slot``. A caller alternates slots when a
        peer may still be reading the previous call's values after the barrier."""
        base = self.meta_index(self.me, len(values), slot)
        assert base + len(values) <= (self.me + 1) * LINE_WORDS
        cells = self.cells
        for offset, value in enumerate(values):
            cells[base + offset] = value

    def meta(self, rank: int, count: int, slot: int) -> tuple[int, ...]:
        base = self.meta_index(rank, count, slot)
        return tuple(self.cells[base:base + count])

    def barrier(self) -> None:
        self.gen += 1
        gen = self.gen
        cells = self.cells
        cells[self.me * LINE_WORDS + SEQ] = gen
        for peer in self.peers:
            if cells[peer * LINE_WORDS + SEQ] < gen:
                self._wait(peer, gen)

    def _wait(self, peer: int, gen: int) -> None:
        words, index = self.cells, peer * LINE_WORDS + SEQ
        start = time.perf_counter()
        spin = self.spin_s
        while time.perf_counter() - start < spin:
            if words[index] >= gen:
                return
        yielded = False  # whether a yield ran another process
        while (now := time.perf_counter()) - start < YIELD_S:
            os.sched_yield()
            yielded = yielded or time.perf_counter() - now > YIELDED_S
            if words[index] >= gen:
                self.spin_s = MIN_SPIN_S if yielded else min(2 * spin, SPIN_S)
                return
        pause, next_check = 20e-6, start + LIVENESS_EVERY_S
        while words[index] < gen:
            time.sleep(pause)
            pause = min(pause * 2, MAX_SLEEP_S)
            now = time.perf_counter()
            if now >= next_check:
                next_check = now + LIVENESS_EVERY_S
                self._check_peer(peer, now - start)

    def _check_peer(self, peer: int, waited: float) -> None:
        pid = self.pid(peer)
        if self.check_pids and pid and not pid_alive(pid):
            raise CommError(
                f"{self.labels[peer]} (pid {pid}) exited during a shared-memory collective; "
                "restart the job (an elastic launcher does this for you)"
            )
        if waited > self.timeout:
            raise CommError(
                f"timed out: {self.labels[peer]} did not reach a shared-memory collective "
                f"within {self.timeout:.0f} s; every rank of the group must call the same "
                "collectives in the same order"
            )
