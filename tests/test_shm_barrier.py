"""The shared-memory barrier's wait (ddpkit/comm/shm/sync.py): how long it spins before
handing its core over, in one process, with the peer's arrival simulated."""

from __future__ import annotations

import os
import time

from ddpkit.comm.shm import sync


def test_the_barrier_spins_briefly_after_its_peer_needed_the_core(monkeypatch):
    buffer = bytearray(sync.block_bytes(2))
    ctl = sync.Control(buffer, 2, 0, timeout=60, labels=["rank 0", "rank 1"])
    ctl.words[1 * 16 + 1] = os.getpid()

    def peer_arrives_on_yield(busy_s):
        def sched_yield():  # the peer runs (for busy_s) and arrives at the barrier
            end = time.perf_counter() + busy_s
            while time.perf_counter() < end:
                pass
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
