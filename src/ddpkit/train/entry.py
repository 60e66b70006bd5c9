"""How a worker process of the training application ends, whichever way it was
started (``ddpkit train``/``ddpkit verify`` launching it, or torchrun, srun or mpirun
running the command on every rank): one exit code per outcome, and a user error printed
once per node rather than once per rank.

Exit codes: 0 done (or stopped by a signal under an agent), 2 a user error,
:data:`~ddpkit.files.durable.EXIT_DISK_FULL` (74) a full disk,
:data:`~ddpkit.train.divergence.EXIT_DIVERGED` (65) a loss that stopped being finite,
:data:`~ddpkit.fault.EXIT_HANG` (124) a collective that timed out. A full disk, a
diverged loss, a configuration or checkpoint error are final: a restart would repeat
them, so ddpkit's launcher is told not to restart
(:func:`ddpkit.runtime.launcher_link.report_final`); the rest (a peer that died, a
hang, a bug) are what ``--max-restarts`` is for."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import record

from ddpkit.checkpoint import CheckpointError
from ddpkit.elastic import host_change
from ddpkit.errors import ConfigError, DdpkitError
from ddpkit.exit_codes import EXIT_DISK_FULL, EXIT_DIVERGED, EXIT_HANG
from ddpkit.fault import HangError
from ddpkit.files.durable import DiskFullError
from ddpkit.runtime.launcher_link import report_final
from ddpkit.train.divergence import DivergedError

# What a restart would only repeat. Not a CommError: a collective that lost a peer that
# died (the shared-memory engine says so) is what a restart is for.
FINAL = (ConfigError, CheckpointError, DiskFullError, DivergedError)


def run_entry(command: str, body: Callable[[], int]) -> int:
    """Run ``body`` as a worker of ``ddpkit COMMAND``; exit codes: ``body``'s own, 2 on a
    user error, :data:`ddpkit.fault.EXIT_HANG` when a collective timed out.

    Wrapped with torch.distributed.elastic's ``record``, so a crash lands in torchrun's
    error file and its summary names the failing rank.
    """
    @record
    def guarded() -> int:
        try:
            # In an elastic job a lost peer is its launcher's to report, in one line.
            return int(host_change.quiet_if_peer_lost(body) or 0)
        except HangError as err:
            # Only this rank knows what it waited for: every rank that times out says so.
            print(f"ddpkit {command}: error: {err}", file=sys.stderr, flush=True)
            return EXIT_HANG
        except DdpkitError as err:
            # Every rank hits the same error (a user error, a full disk, a diverged loss
            # are agreed by all ranks): one line per node is enough.
            code = (EXIT_DISK_FULL if isinstance(err, DiskFullError) else
                    EXIT_DIVERGED if isinstance(err, DivergedError) else 2)
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"ddpkit {command}: error: {err}", file=sys.stderr, flush=True)
            if isinstance(err, FINAL):
                report_final(code)
            return code

    return guarded()
