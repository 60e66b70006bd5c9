"""Start N local workers directly, for the one case that needs nothing of an agent.

``ddpkit train`` and ``ddpkit verify`` on one node with no restarts asked for used to
go through torchrun's elastic agent, which costs the launching process ``import torch``
and ``torch.distributed.run`` (2-3 s here) before any worker starts, and a monitor
loop and shutdown after the last one ends. None of it is used when nothing is
restarted and there is no rendezvous to host: the workers' own ``env://`` rendezvous
(rank 0 hosts the store) is enough. So this launcher, which never imports torch:

* gives every worker torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR/PORT on a free port,
  TORCHELASTIC_RESTART_COUNT/MAX_RESTARTS, an error file for ``@record``);
* prefixes each output line ``[default<local rank>]:`` as ``--tee 3`` does, through
  the :class:`~ddpkit.console.Console` that also draws rank 0's progress;
* when a worker fails, stops the others (SIGTERM, then SIGKILL) and reports the root
  cause in one line, by the rule :func:`ddpkit.launch.root_cause` applies to the agent's;
* passes SIGTERM/SIGINT on to the workers (SIGINT as SIGTERM: stop at the next step
  with a checkpoint) and returns 128 + the signal.

Multi-node runs, ``--max-restarts``, ``ddpkit launch`` and ``DDPKIT_LAUNCHER=torchrun``
keep torchrun's agent (:func:`ddpkit.launch.launch_argv`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO, TextIO

from ddpkit.console import Console

ROLE = "default"
STOP_GRACE_S = 30.0  # after SIGTERM, how long a worker may take before SIGKILL


@dataclass
class WorkerExit:
    """One worker's end, shaped like torchrun's ProcessFailure for ``root_cause``."""

    local_rank: int
    pid: int
    exitcode: int
    timestamp: float
    message: str = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_message(path: str) -> str:
    """The message ``@record`` wrote for a worker that raised, or ''."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return ""
    message = data.get("message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message)


def _pump(src: BinaryIO, console: Console, dst: TextIO, prefix: str) -> None:
    for raw in iter(src.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        console.write(dst, prefix + line)
    src.close()


def launch_local(cmd: Sequence[str], nproc: int, console: Console) -> tuple[int, list[WorkerExit]]:
    """Run ``cmd`` as ``nproc`` local ranks; (exit code, the failures in order)."""
    tmp = tempfile.mkdtemp(prefix="ddpkit-launch-")
    port = free_port()
    run_id = f"ddpkit-{os.getpid()}-{port}"
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []

    def stop_all(sig: int) -> None:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    def on_signal(signum, frame) -> None:
        received.append(signum)
        stop_all(signal.SIGTERM if signum == signal.SIGINT else signum)

    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in handled}
    try:
        for rank in range(nproc):
            env = {**os.environ,
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                   "ROLE_RANK": str(rank), "ROLE_NAME": ROLE, "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
                   "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_MAX_RESTARTS": "0", "DDPKIT_RUN_ID": run_id,
                   "TORCHELASTIC_ERROR_FILE": os.path.join(tmp, f"error-{rank}.json")}
            # Own session: a terminal's Ctrl-C reaches the launcher, which stops the
            # workers the way a scheduler would (SIGTERM: checkpoint, then exit).
            p = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
            procs.append(p)
            prefix = f"[{ROLE}{rank}]:"
            for src, dst in ((p.stdout, console.stdout), (p.stderr, console.stderr)):
                t = threading.Thread(target=_pump, args=(src, console, dst, prefix),
                                     daemon=True)
                t.start()
                pumps.append(t)

        failures: list[WorkerExit] = []
        stop_deadline = None
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                code = p.poll()
                if code is None or any(f.local_rank == rank for f in failures):
                    continue
                if code != 0 and not (code == 75 and not failures):
                    failures.append(WorkerExit(rank, p.pid, code, time.time(),
                                               _error_message(os.path.join(
                                                   tmp, f"error-{rank}.json"))))
            if failures and stop_deadline is None:
                stop_all(signal.SIGTERM)  # as the agent does: one failed, stop the rest
                stop_deadline = time.monotonic() + STOP_GRACE_S
            if received and stop_deadline is None:
                stop_deadline = time.monotonic() + STOP_GRACE_S
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                stop_all(signal.SIGKILL)
            time.sleep(0.02)
        for rank, p in enumerate(procs):
            code = p.returncode
            if code not in (0, 75) and not any(f.local_rank == rank for f in failures):
                failures.append(WorkerExit(rank, p.pid, code, time.time(),
                                           _error_message(os.path.join(
                                               tmp, f"error-{rank}.json"))))
        for t in pumps:
            t.join(timeout=5)
        if received:
            return 128 + received[0], failures
        if failures:
            return 1, failures
        return (75 if any(p.returncode == 75 for p in procs) else 0), []
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_all(signal.SIGKILL)
        with contextlib.suppress(OSError):
            for name in os.listdir(tmp):
                os.unlink(os.path.join(tmp, name))
            os.rmdir(tmp)


def python_command(target: str, args: Sequence[str], *, module: bool,
                   no_python: bool = False) -> list[str]:
    """The worker command line torchrun would run for ``target``."""
    if no_python:
        return [target, *args]
    return [sys.executable, "-u", *(["-m"] if module else []), target, *args]
