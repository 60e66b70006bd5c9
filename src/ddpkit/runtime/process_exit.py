"""How a ddpkit process that succeeded ends: without the interpreter's finalization.

Tearing down a process that imported torch (and torch._dynamo, which its optimizers
import) is slow: every module and object freed one by one, then torch's C++ destructors,
all after the work is done and its files are closed (the main job's exit, before and
after: benchmarks/RESULTS-history.md, start-up; the launcher's own process:
benchmarks/RESULTS-history.md, "The suite under 10 minutes"). What finalization would do that
matters is done first: non-daemon threads finish, ``atexit`` handlers run (logging's
flush, ``weakref.finalize`` callbacks and ddpkit's own teardown among them, which
destroys the process groups first: :mod:`ddpkit.runtime.lifetime`), stdout and stderr are
flushed. Everything else the OS reclaims.

Used by every worker of ``ddpkit train``/``ddpkit verify`` and by the ``ddpkit`` command
itself (the launcher's agent process); never by a user's program.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """End this process with ``code``; a successful one skips the interpreter's
    finalization. (A failed one exits the usual way: it is not in a hurry, and a peer
    that dies of its loss should not end before the rank that caused it.)"""
    if code != 0:
        sys.exit(code)
    # As finalization does: first the hooks registered with threading (they stop the
    # worker threads of concurrent.futures executors, e.g. torch.compile's compile
    # pool, which would otherwise wait for work forever), then the joins.
    for hook in reversed(getattr(threading, "_threading_atexits", [])):
        hook()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
