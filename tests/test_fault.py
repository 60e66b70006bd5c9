"""Hang detection names the missing rank; preemption stops every rank at the same step."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpkit.fault import (
    EXIT_HANG,
    HangError,
    PreemptionGuard,
    ProgressBoard,
    Watchdog,
)

TIMEOUT = 2.0
MARGIN = 2.0  # generous: two cores shared with other test runs


def _prefix() -> str:
    return f"test/{uuid.uuid4().hex[:8]}"  # fresh keys per test in the pool's shared store


# ------------------------------------------------------------------ progress board (no processes)
def test_board_reports_ranks_behind_and_silent_ranks():
    store = dist.HashStore()
    boards = [ProgressBoard(store, rank=r, world_size=3, prefix="p") for r in range(3)]
    boards[0].publish(7, "forward")
    boards[0].publish(7, "allreduce")
    boards[1].publish(7, "forward")
    behind = boards[0].behind()
    assert [(p.rank, p.seq, p.step, p.name) for p in behind] == [
        (1, 0, 7, "forward"), (2, -1, -1, "")
    ]
    assert behind[1].describe() == "rank 2 (never reported progress)"
    assert behind[0].describe().startswith("rank 1 (last at step 7 'forward', 0.")


# ------------------------------------------------------------------ store barrier
def _late_rank_at_barrier(world, prefix, sleep_s, steps):
    wd = Watchdog(TIMEOUT, board=ProgressBoard(prefix=prefix), exit_on_hang=False)
    try:
        for step in range(steps):
            wd.progress(step, "data")
            if world.rank == 1 and step == steps - 1:
                time.sleep(sleep_s)
            start = time.monotonic()
            try:
                wd.barrier(step, "end_of_step")
            except HangError as err:
                return "hang", err.missing, str(err), time.monotonic() - start
        return "ok", [], "", 0.0
    finally:
        wd.close()


def test_barrier_timeout_names_the_sleeping_rank(pools):
    # The late rank sleeps well past the timeout: a FileStore's wait (the pool's store)
    # polls and may overshoot by up to a second; a TCPStore's wait does not.
    results = pools(2).run(_late_rank_at_barrier, _prefix(), TIMEOUT + 2.5, 3)
    kind, missing, message, waited = results[0]
    assert kind == "hang" and missing == [1]
    assert TIMEOUT - 0.1 <= waited <= TIMEOUT + MARGIN, waited
    assert "rank 0 waited" in message and "at step 2 'end_of_step'" in message
    assert "rank 1 (last at step 2 'data'" in message
    assert results[1][0] == "ok"  # the late rank arrives after rank 0 gave up: no hang for it


def test_slow_rank_within_timeout_completes(pools):
    results = pools(2).run(_late_rank_at_barrier, _prefix(), TIMEOUT * 0.5, 4)
    assert [r[0] for r in results] == ["ok", "ok"]


# ------------------------------------------------------------------ guard around a real collective
def _late_rank_in_collective(world, prefix, sleep_s):
    group = dist.new_group(timeout=timedelta(seconds=TIMEOUT))  # the backend's own timeout
    wd = Watchdog(TIMEOUT, board=ProgressBoard(prefix=prefix), exit_on_hang=False)
    outcome = ("ok", [], "", 0.0)
    try:
        wd.progress(4, "forward")
        if world.rank == 1:
            time.sleep(sleep_s)
        start = time.monotonic()
        if world.rank == 0 or sleep_s < TIMEOUT:
            x = torch.full((4,), float(world.rank + 1))
            try:
                with wd.guard(4, "grad_allreduce"):
                    dist.all_reduce(x, group=group)
                outcome = ("ok", x.tolist(), "", time.monotonic() - start)
            except HangError as err:
                outcome = ("hang", err.missing, str(err), time.monotonic() - start)
    finally:
        wd.close()
        dist.barrier()  # both ranks are done with the broken group before it goes
        dist.destroy_process_group(group)
    return outcome


def test_collective_timeout_names_the_missing_rank(pools):
    results = pools(2).run(_late_rank_in_collective, _prefix(), TIMEOUT + 1.5)
    kind, missing, message, waited = results[0]
    assert kind == "hang" and missing == [1], message
    assert waited <= TIMEOUT + MARGIN
    assert "step 4 'grad_allreduce'" in message and "rank 1 (last at step 4 'forward'" in message
    assert "[backend:" in message  # the backend's own words are kept


def test_slow_rank_within_collective_timeout_completes(pools):
    results = pools(2).run(_late_rank_in_collective, _prefix(), TIMEOUT * 0.4)
    assert [r[0] for r in results] == ["ok", "ok"]
    assert results[0][1] == results[1][1] == [3.0] * 4


def test_guard_leaves_other_errors_alone():
    board = ProgressBoard(dist.HashStore(), rank=0, world_size=1)
    wd = Watchdog(5, board=board, exit_on_hang=False)
    with pytest.raises(ValueError), wd.guard(0, "x"):
        raise ValueError("shape mismatch")
    with pytest.raises(RuntimeError, match="size of tensor"), wd.guard(0, "y"):
        torch.ones(2) + torch.ones(3)
    wd.close()


def test_backstop_logs_a_hang_the_backend_does_not_report():
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ddpkit").addHandler(handler)
    board = ProgressBoard(dist.HashStore(), rank=0, world_size=2, prefix="b")
    try:
        with Watchdog(0.3, board=board, grace=0.2, exit_on_hang=False) as wd, wd.guard(9, "stuck"):
            time.sleep(1.0)  # stands in for a C++ collective that never returns
    finally:
        logging.getLogger("ddpkit").removeHandler(handler)
    assert any("hang:" in x and "rank 1 (never reported progress)" in x for x in lines), lines


# The ddpkit command's workers print ddpkit's log lines to stderr (a library alone adds
# only a NullHandler): the children here are such workers.
_AS_UNDER_THE_CLI = {**os.environ, "DDPKIT_CLI_LOGGING": "1"}

BACKSTOP_CHILD = textwrap.dedent(
    """
    import time
    import torch.distributed as dist
    from ddpkit.fault import ProgressBoard, Watchdog
    board = ProgressBoard(dist.HashStore(), rank=0, world_size=2, prefix="b")
    for step in range(6):
        board.publish(step * 2, "data")  # rank 0 is at seq 5, then 6 inside the guard
    board.store.set("b/rank1", "3|12|%f|data" % time.time())  # rank 1 stopped at seq 3
    with Watchdog(0.5, board=board, grace=0.3).guard(12, "allreduce"):
        time.sleep(60)
    """
)


def test_backstop_exits_the_process_with_the_hang_code():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BACKSTOP_CHILD], capture_output=True, text=True,
                          timeout=120, env=_AS_UNDER_THE_CLI)
    assert proc.returncode == EXIT_HANG, proc.stderr
    assert "rank 1 (last at step 12 'data'" in proc.stderr
    assert time.monotonic() - start < 60


FROZEN_CHILD = textwrap.dedent(
    """
    import sys, time
    import torch.distributed as dist
    from ddpkit.fault import ProgressBoard, Watchdog
    board = ProgressBoard(dist.HashStore(), rank=0, world_size=2, prefix="b")
    board.store.set("b/rank1", "0|4|%f|data" % time.time())
    with Watchdog(0.5, board=board, grace=1.0).guard(4, "allreduce"):
        print("armed", flush=True)
        time.sleep(60)
    """
)


def test_a_rank_that_was_stopped_says_so_instead_of_blaming_its_peers():
    """SIGSTOP past its deadline, then SIGCONT (what a launcher does to stop it cleanly):
    the rank's own line says it was not running, not that a peer kept it waiting."""
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_CHILD], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_AS_UNDER_THE_CLI)
    try:
        assert proc.stdout.readline().strip() == "armed"
        proc.send_signal(signal.SIGSTOP)
        time.sleep(5.0)  # the deadline (0.5 + 1.0 s) passes while the process is stopped
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_HANG, err
    assert re.search(r"rank 0: this process was not running for \d+ s \(stopped", err), err
    assert "during 'allreduce' at step 4" in err and "waited" not in err, err


def test_a_peer_that_reached_the_point_and_stopped_running_is_named():
    """Both ranks published the step, then rank 1's heartbeat went stale: it is the one
    that stopped, not the network."""
    board = ProgressBoard(dist.HashStore(), rank=0, world_size=2, prefix="s")
    board.store.set("s/rank1", f"0|7|{time.time():f}|allreduce")
    board.store.set("s/beat1", f"{time.time() - 12:f}")
    wd = Watchdog(5, board=board, exit_on_hang=False)
    with pytest.raises(HangError) as caught, wd.guard(7, "allreduce"):
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    wd.close()
    assert "rank 1 (no heartbeat for 12 s) reached it, then stopped running" in str(caught.value)
    # A fresh heartbeat: every rank reached it and runs, so the network is to blame.
    board.store.set("s/rank1", f"1|7|{time.time():f}|allreduce")
    board.store.set("s/beat1", f"{time.time():f}")
    with pytest.raises(HangError, match="network or backend stall"), wd.guard(7, "allreduce"):
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    wd.close()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout must be positive"):
        Watchdog(0, board=ProgressBoard(dist.HashStore(), rank=0, world_size=1))


# ------------------------------------------------------------------ preemption
def _preempt_one_rank(world, signum, victim):
    pids = [None] * world.world_size
    dist.all_gather_object(pids, os.getpid())
    with PreemptionGuard() as guard:
        dist.barrier()  # every rank's handler is installed before anyone sends a signal
        for step in range(500):
            time.sleep(0.005)
            if world.rank == 0 and step == 5:
                os.kill(pids[victim], signum)  # from outside the victim, like a scheduler
            if guard.should_stop(step):
                break
    return step, guard.requested, guard.stopped_by, signal.getsignal(signum) == signal.SIG_DFL


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_one_rank_stops_all_at_the_same_step(pools, signum):
    results = pools(2).run(_preempt_one_rank, signum, 1)
    steps = [r[0] for r in results]
    assert len(set(steps)) == 1 and 5 <= steps[0] < 499, steps
    assert [r[1] for r in results] == [False, True]  # only the victim got the signal
    assert all(r[2] == signum for r in results)
    assert all(r[3] for r in results)  # default handlers are back after the guard


def test_check_every_skips_communication_between_checks():
    guard = PreemptionGuard(check_every=4)
    guard.request(signal.SIGUSR1)
    assert guard.requested
    assert [guard.should_stop(s) for s in (1, 2, 3)] == [False, False, False]
    assert guard.should_stop(4) and guard.stopped_by == signal.SIGUSR1
    assert guard.should_stop(5)  # once agreed, it stays agreed


def test_check_every_must_be_positive():
    with pytest.raises(ValueError, match="check_every must be >= 1, got 0"):
        PreemptionGuard(check_every=0)


def _save_due_on_one_rank(world):
    with PreemptionGuard() as guard:
        decisions = [guard.check(step, save_due=(world.rank == 1 and step == 2))
                     for step in range(4)]
    return decisions


def test_a_save_due_on_one_rank_is_agreed_by_all(pools):
    results = pools(2).run(_save_due_on_one_rank)
    expected = [(False, False), (False, False), (False, True), (False, False)]
    assert results == [expected, expected]
