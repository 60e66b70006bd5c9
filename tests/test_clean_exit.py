"""Programs that use ddpkit end with exit code 0, and nothing of a process group is left
running when the interpreter starts finalizing.

The failure this guards against: a gloo thread that frees a finished collective's Python
objects after finalization began aborts the process ("terminate called without an
active exception", SIGABRT) after a program that succeeded (ddpkit/lifetime.py). It is
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


def launch(script: str, nranks: int, runs: int, *args: str, runner: bool = False) -> list:
    argv = [sys.executable, REPEAT, *(["--runner"] if runner else []),
            os.path.join(PROGRAMS, script), str(nranks), str(runs), *args]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_clean(report: list) -> None:
    for i, run in enumerate(report):
        for rank, (code, threads, tail) in enumerate(
                zip(run["codes"], run["threads"], run["tails"])):
            assert code == 0, f"run {i} rank {rank} exited {code}:\n{tail}"
            assert threads is not None, f"run {i} rank {rank} never reached its last atexit"
            left = [t for t in threads if t.startswith(GROUP_THREADS)]
            assert not left, (f"run {i} rank {rank}: process-group threads {left} still "
                              "alive at the last atexit handler")


# The default-collectives script and DataParallel without teardown run twenty times below.
PROGRAM_CASES = [
    pytest.param("ring_grid.py", 3, (), False, id="ring-grid"),
    pytest.param("async_collectives.py", 3, (), False, id="async-lanes-no-teardown"),
    pytest.param("ddp_adamw.py", 2, ("--width", "256"), False, id="dataparallel-adamw"),
    # torch's own DDP, nothing of ddpkit imported, run the way `ddpkit launch` runs it
    pytest.param("ddp_adamw.py", 2, ("--width", "256", "--torch", "--no-teardown"), True,
                 id="torch-ddp-under-ddpkit-launch"),
]


@pytest.mark.parametrize("script,nranks,args,runner", PROGRAM_CASES)
def test_no_process_group_thread_is_left_at_exit(script, nranks, args, runner):
    assert_clean(launch(script, nranks, 1, *args, runner=runner))


@pytest.mark.parametrize("script,nranks,args", [
    ("default_collectives.py", 2, ()),
    ("ddp_adamw.py", 2, ("--width", "256", "--no-teardown")),
])
def test_twenty_runs_exit_clean(script, nranks, args):
    assert_clean(launch(script, nranks, 20, *args))
