"""A torch 2.13 + gloo abort at interpreter exit, and the one retry the tests allow for it.

A collective launched during backward keeps backward's stashed contextvars Context
(autograd/graph.py, _stash_obj_in_tls) in its Work; when a gloo worker thread drops the
last reference to that Work after the interpreter started finalizing, the decref cannot
take the GIL, the thread is unwound and std::terminate aborts the process, after the
program's last line (core dump: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork ->
~ThreadLocalState -> SafePyObject decref -> take_gil -> pthread_exit). Measured here at
load 5-7 on 2 cores: about 1 run in 8, plain torch programs under torchrun included.
ddpkit's own workers skip finalization after a success (ddpkit.train.entry.exit_process)
and do not hit it; user programs and the seed examples can. A run that failed with
exactly this message is run again; any other failure is not.
"""

from __future__ import annotations

import subprocess

EXIT_ABORT = "terminate called without an active exception"
ATTEMPTS = 3


def run_retrying_exit_abort(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, **kwargs)``, again (up to
    ATTEMPTS times) only when it failed with the exit abort and nothing else."""
    for _ in range(ATTEMPTS):
        proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
        if proc.returncode == 0 or EXIT_ABORT not in proc.stdout + proc.stderr:
            return proc
    return proc
