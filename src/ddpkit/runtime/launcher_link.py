"""The bond between ddpkit's launcher and the workers it starts.

* **A worker dies with its launcher.** torchrun's agent starts every worker in a session
  of its own, so a launcher killed outright (SIGKILL from the OOM killer or a scheduler)
  takes nothing with it: without this, workers whose store outlives the agent (rank 0
  hosts it under ``--max-restarts``) train on headless and keep writing checkpoints,
  and a ``--resume`` started then puts two writers in one run directory.
  :func:`die_with_launcher` asks the kernel to SIGKILL this process when its parent
  dies (Linux ``PR_SET_PDEATHSIG``), and ends it at once if that already happened.
* **A worker can tell that its failure is final.** The agent restarts workers after any
  failure (``--max-restarts``), also after one that a restart only repeats: a user
  error, a full disk, a diverged loss. :func:`report_final` tells the launcher (a real-
  time signal whose number says the exit code); :func:`linked_workers` is the
  launcher's side: it stops the agent instead of restarting and exits with that code.
* **A stopped worker hears its stop signal.** A worker stopped with SIGSTOP (or by a
  debugger, or a terminal's job control) keeps the SIGTERM the agent sends it pending,
  and the agent waits out its whole grace period (30 s) before SIGKILL.
  :func:`continue_stopped_children` continues such a worker, so that it acts on the
  SIGTERM at once, as its peers do.

Both act only between a worker and the ddpkit launcher that started it
(:data:`LAUNCHER_ENV` names that launcher's pid, and it must be the parent): under
torchrun, srun or mpirun they do nothing. Torch-free.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

LAUNCHER_ENV = "DDPKIT_LAUNCHER_PID"  # set by ddpkit's launcher for the workers it starts
# Exit codes a restart cannot change, each carried by its own real-time signal:
# 2 a user error, 65 a diverged run, 74 a full disk.
FINAL_CODES = (2, 65, 74)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _launcher_pid() -> int | None:
    """The pid of the ddpkit launcher that started this process, if it is our parent."""
    value = os.environ.get(LAUNCHER_ENV, "")
    return int(value) if value.isdigit() and int(value) == os.getppid() else None


def die_with_launcher() -> None:
    """Make the kernel SIGKILL this process when the launcher that started it dies.

    Call it first thing in a worker. The launcher may have died already (between
    starting us and this call): then the parent is no longer the pid the launcher
    gave, and we exit at once.
    """
    expected = os.environ.get(LAUNCHER_ENV, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here (seccomp): keep running, as without a launcher link
    if os.getppid() != int(expected):
        os._exit(1)  # orphaned before we could ask: the launcher is gone


def _signal_for(code: int) -> int:
    return signal.SIGRTMIN + FINAL_CODES.index(code)


def report_final(code: int) -> None:
    """Tell the launcher that this worker ends with ``code`` and that restarting the
    workers would only repeat it. Send it after the worker's message is out: the
    launcher then stops every worker."""
    pid = _launcher_pid()
    if pid is None or code not in FINAL_CODES or not hasattr(signal, "SIGRTMIN"):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, _signal_for(code))


@dataclass
class FinalFailure:
    """What a launcher learned from :func:`report_final`: the first worker's exit code."""

    code: int | None = None


@contextlib.contextmanager
def linked_workers(stop: Callable[[], BaseException],
                   final_grace: float = 10.0) -> Iterator[FinalFailure]:
    """The launcher's side, around the agent's run: the environment its workers
    inherit names this process (so they die with it), and the first final failure a
    worker reports raises
    ``stop()`` in the main thread (torchrun's agent stops its workers on a
    ``SignalException``, as it does for SIGTERM) after recording its exit code in the
    yielded :class:`FinalFailure`, and after waiting up to ``final_grace`` seconds for
    the workers to end by themselves."""
    seen = FinalFailure()
    if not hasattr(signal, "SIGRTMIN"):
        yield seen
        return

    def handler(signum, frame):
        if seen.code is None:  # the first report stops the agent; later ones are its echo
            seen.code = FINAL_CODES[signum - signal.SIGRTMIN]
            # Every rank ends on the same agreed error: let them end on their own (the
            # one that prints may be a moment behind the one that reported), so that
            # the agent's stop signal cuts no message short. The agent's loop is this
            # thread, so it restarts nothing meanwhile; its output threads go on.
            _wait_for_children(final_grace)
            raise stop()

    signals = [_signal_for(code) for code in FINAL_CODES]
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    env_before = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    try:
        yield seen
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if env_before is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = env_before


def child_pids(parent: int | None = None) -> list[int]:
    """The direct children of ``parent`` (default: this process), from /proc (Linux)."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = stat[stat.rfind(")") + 2:].split()
            if len(fields) > 1 and int(fields[1]) == parent:
                found.append(int(entry.name))
    return found


def _wait_for_children(limit: float) -> None:
    """Until every child of this process has exited (a zombie waits for the agent to
    reap it), or ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and any(_state(pid) not in ("Z", "X", "")
                                              for pid in child_pids()):
        time.sleep(0.05)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2]
    return ""


def stopped_with_pending_term(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, job control, not traced) with a SIGTERM
    waiting for it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if not fields.get("State", "").strip().startswith("T"):
        return False
    term = 1 << (signal.SIGTERM - 1)
    return any(int(fields.get(key, "0").strip() or "0", 16) & term
               for key in ("SigPnd", "ShdPnd"))


@contextlib.contextmanager
def continue_stopped_children(interval: float = 0.5) -> Iterator[None]:
    """While the block runs, continue (SIGCONT) any child of this process that is
    stopped with a SIGTERM pending: the agent's stop then takes effect at once."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval):
            for pid in child_pids():
                if stopped_with_pending_term(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=watch, name="ddpkit-continue-stopped", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
