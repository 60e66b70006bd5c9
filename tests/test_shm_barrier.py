"""The shared-memory barrier's wait (ddpkit/comm/shm/sync.py): how long it spins before
handing its core over, in one process, with the peer's arrival and the clock simulated.

The clock is simulated too: with the real one, a test process preempted for longer than
the yielding phase (a loaded CI box) would skip the yields the simulated peer answers."""

from __future__ import annotations

import os

import pytest

from ddpkit.comm.shm import sync


class FakeTime:
    """``sync``'s view of :mod:`time`: each reading advances a little, as a spinning loop
    sees it; sleeping would mean the yields were skipped, which this test must not do."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-7
        return self.now

    def sleep(self, seconds: float) -> None:
        pytest.fail(f"the barrier slept ({seconds} s) instead of yielding")


def test_the_barrier_spins_briefly_after_its_peer_needed_the_core(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(sync, "time", clock)
    buffer = bytearray(sync.block_bytes(2))
    ctl = sync.Control(buffer, 2, 0, timeout=60, labels=["rank 0", "rank 1"])
    ctl.words[1 * 16 + 1] = os.getpid()

    def peer_arrives_on_yield(busy_s):
        def sched_yield():  # the peer runs (for busy_s) and arrives at the barrier
            clock.now += busy_s
            ctl.words[1 * 16 + sync.SEQ] = ctl.gen
        return sched_yield

    assert ctl.spin_s == sync.SPIN_S
    # the yield ran the peer: spinning only kept it off the core
    monkeypatch.setattr(sync.os, "sched_yield", peer_arrives_on_yield(10 * sync.YIELDED_S))
    ctl.barrier()
    assert ctl.spin_s == sync.MIN_SPIN_S
    # yields that come straight back: the core was not wanted, spinning is cheap again
    monkeypatch.setattr(sync.os, "sched_yield", peer_arrives_on_yield(0))
    for _ in range(20):
        ctl.barrier()
    assert ctl.spin_s == sync.SPIN_S
