"""The test pool itself (tests/dist_pool.py): a rank that dies is a failure at once.

A worker killed by a signal (a crash in native code) answers nothing; the pool must say
which rank died, of what, and where its threads were, instead of waiting out the task's
timeout (a 3-rank pool once sat 300 s on ranks that had all crashed).
"""

from __future__ import annotations

import os
import signal

import pytest

from dist_pool import DistPool, RankFailure


def crash_on_last_rank(world):
    if world.rank == world.world_size - 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return world.rank


def test_a_rank_that_crashes_is_named_with_its_signal_and_stack_not_waited_for():
    pool = DistPool(2)
    try:
        # (waiting out the timeout would raise TimeoutError instead)
        with pytest.raises(RankFailure) as raised:
            pool.run(crash_on_last_rank, timeout=120)
    finally:
        pool.close()
    assert raised.value.rank == 1
    assert "killed by SIGSEGV" in raised.value.text, raised.value.text
    assert "in crash_on_last_rank" in raised.value.text, raised.value.text
