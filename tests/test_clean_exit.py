"""Programs that use ddpkit end with exit code 0, and nothing of a process group is left
running when the interpreter starts finalizing.

The failure this guards against: a gloo thread that frees a finished collective's Python
objects after finalization began aborts the process ("terminate called without an
active exception", SIGABRT) after a program that succeeded (ddpkit/runtime/lifetime.py). It is
rare and load-dependent, so counting exits alone can miss it; what makes it possible at
all is deterministic: a process group whose threads are still alive when the last atexit
handler runs. Each program here is run as a user runs it (each rank its own process,
leaving through the interpreter's finalization: tests/repeat_launch.py), and every rank
reports the threads it still has at that point; none may belong to a process group
(gloo's run loops and socket loop, the store's server). The programs are the ones
benchmarks/clean_exit.py launches under torchrun and ``ddpkit launch``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

PROGRAMS = os.path.join(ROOT, "benchmarks", "exit_programs")
REPEAT = os.path.join(ROOT, "tests", "repeat_launch.py")
# Threads torch names for a process group and its store (c10::setThreadName).
GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv", "pt_nccl")


# Two programs run several times: the default-collectives script, and DataParallel without
# teardown. The abort this guards against came in about one run of three, so a handful of
# exit codes alone would miss it often; what catches it is the check on the threads left at
# the last atexit handler (assert_clean), which sees what makes the abort possible in every
# single run, aborted or not. So a few runs suffice here; many more, under torchrun and
# `ddpkit launch` themselves: benchmarks/clean_exit.py (benchmarks/RESULTS.md).
RUNS = 5
OPTIMIZER = ["torch._dynamo"]  # what torch.optim imports on first use (tests/repeat_launch.py)
# name -> (script, ranks, arguments, through ddpkit's script runner, runs, preload);
# jobs that preload come last (a preload stays for the jobs after it).
JOBS = {
    # one run each: no process-group thread is left at the last atexit handler
    "ring-grid": ("ring_grid.py", 3, [], False, 1, []),
    "async-lanes-no-teardown": ("async_collectives.py", 3, [], False, 1, []),
    "default-collectives-repeated": ("default_collectives.py", 2, [], False, RUNS, []),
    "dataparallel-adamw": ("ddp_adamw.py", 2, ["--width", "256"], False, 1, OPTIMIZER),
    # torch's own DDP, nothing of ddpkit imported, run the way `ddpkit launch` runs it
    "torch-ddp-under-ddpkit-launch": (
        "ddp_adamw.py", 2, ["--width", "256", "--torch", "--no-teardown"], True, 1, []),
    "dataparallel-no-teardown-repeated": (
        "ddp_adamw.py", 2, ["--width", "256", "--no-teardown"], False, RUNS, []),
}


@pytest.fixture(scope="module")
def reports() -> dict[str, list]:
    """Every job above, run by one tests/repeat_launch.py process (torch imported once)."""
    jobs = [{"script": os.path.join(PROGRAMS, script), "nranks": nranks, "runs": runs,
             "args": args, "runner": runner, "preload": preload}
            for script, nranks, args, runner, runs, preload in JOBS.values()]
    proc = subprocess.run([sys.executable, REPEAT, "--jobs", json.dumps(jobs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return dict(zip(JOBS, json.loads(proc.stdout.strip().splitlines()[-1])))


def assert_clean(report: list, runs: int, nranks: int) -> None:
    assert len(report) == runs, f"{len(report)} runs reported, {runs} started"
    for i, run in enumerate(report):
        assert len(run["codes"]) == len(run["threads"]) == len(run["tails"]) == nranks, (
            f"run {i}: {len(run['codes'])} ranks reported, {nranks} started")
        for rank, (code, threads, tail) in enumerate(
                zip(run["codes"], run["threads"], run["tails"])):
            assert code == 0, f"run {i} rank {rank} exited {code}:\n{tail}"
            assert threads is not None, f"run {i} rank {rank} never reached its last atexit"
            left = [t for t in threads if t.startswith(GROUP_THREADS)]
            assert not left, (f"run {i} rank {rank}: process-group threads {left} still "
                              "alive at the last atexit handler")


@pytest.mark.parametrize("job", [job for job, spec in JOBS.items() if spec[4] == 1])
def test_no_process_group_thread_is_left_at_exit(reports, job):
    assert_clean(reports[job], 1, JOBS[job][1])


@pytest.mark.parametrize("job", [job for job, spec in JOBS.items() if spec[4] == RUNS])
def test_repeated_runs_exit_clean(reports, job):
    assert_clean(reports[job], RUNS, JOBS[job][1])
