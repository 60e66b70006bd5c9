"""How a worker process of the training application ends, whichever way it was
started (``ddpkit train``/``ddpkit verify`` launching it, or torchrun, srun or mpirun
running the command on every rank): one exit code per outcome, and a user error printed
once per node rather than once per rank."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import record

from ddpkit.errors import DdpkitError
from ddpkit.fault import EXIT_HANG, HangError


def run_entry(command: str, body: Callable[[], int]) -> int:
    """Run ``body`` as a worker of ``ddpkit COMMAND``; exit codes: ``body``'s own, 2 on a
    user error, :data:`ddpkit.fault.EXIT_HANG` when a collective timed out.

    Wrapped with torch.distributed.elastic's ``record``, so a crash lands in torchrun's
    error file and its summary names the failing rank.
    """
    @record
    def guarded() -> int:
        try:
            return int(body() or 0)
        except HangError as err:
            # Only this rank knows what it waited for: every rank that times out says so.
            print(f"ddpkit {command}: error: {err}", file=sys.stderr, flush=True)
            return EXIT_HANG
        except DdpkitError as err:
            # Every rank hits the same user error: one line per node is enough.
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"ddpkit {command}: error: {err}", file=sys.stderr, flush=True)
            return 2

    return guarded()
