"""Which rank's failure caused a failed launch, and the one line that names it.

torchrun's agent hands back one ``ProcessFailure`` per failed rank; most of them are
ranks that failed only because a peer went first (a broken connection, the agent's own
SIGTERM). ``ddpkit launch`` prints one line naming the cause, so a user reads one
traceback, not one per rank.
"""

from __future__ import annotations

import signal
import sys

# Messages of ranks that died only because a peer went away first.
_PEER_GONE = ("Connection closed by peer", "Connection reset", "Broken pipe", "DistBackendError",
              "DistNetworkError", "exited during a shared-memory collective")


# What torch's ProcessFailure holds as the message when the rank wrote no error file.
_NO_ERROR_FILE = "<NONE>"


def _recorded(failure) -> bool:
    """Whether the rank wrote its own exception to its error file (``@record``).

    Such a rank raised by itself: the agent's SIGTERM may still reach it while the
    interpreter winds down, after its peers already saw the connection drop and exited.
    """
    message = getattr(failure, "error_file_data", {}).get("message")
    return message not in (None, "", _NO_ERROR_FILE)


def _lost_a_peer(failure) -> bool:
    """Whether the rank's message says it failed because a peer went away."""
    message = str(getattr(failure, "message", ""))
    return any(p in message for p in _PEER_GONE)


def root_cause(failures: dict) -> tuple[int, object]:
    """The failure that caused the others.

    A rank killed by a signal of its own (SIGKILL from the OOM killer, SIGSEGV) had no
    chance to report and its peers fail within moments of it, often in an earlier
    second of torchrun's clock: it is the cause. Exit -SIGTERM is the agent stopping the
    survivors, never the cause. Otherwise the earliest error wins; torchrun's timestamps
    have one-second resolution, so a rank that raised and the peer whose collective then
    broke usually tie, and among those we prefer the failure that is not a lost connection.
    """
    def key(item):
        rank, failure = item
        # A rank that recorded its exception ended by itself, whatever signal came after.
        signalled = failure.exitcode < 0 and not _recorded(failure)
        stopped_by_agent = signalled and failure.exitcode == -signal.SIGTERM
        killed_by_signal = signalled and not stopped_by_agent
        return (stopped_by_agent, not killed_by_signal, failure.timestamp,
                _lost_a_peer(failure), rank)

    return min(failures.items(), key=key)


def report_failure(failures: dict, role: str, plain_rank0: bool = False) -> int:
    """Print the one line naming the root cause of ``failures``; its exit code.
    ``plain_rank0``: local rank 0's lines were shown without their prefix."""
    rank, failure = root_cause(failures)
    others = sorted(r for r in failures if r != rank)
    also = f"; ranks {others} failed after it" if others else ""
    if failure.exitcode < 0 and not _recorded(failure):  # no traceback to point at
        what = (f"was killed by {signal.Signals(-failure.exitcode).name} "
                f"(pid {failure.pid}; out of memory or killed from outside?)")
    else:
        prefix = f"[{role}{failure.local_rank}]"
        # Python exits 1 after an uncaught exception's traceback. ddpkit's other codes
        # follow a one-line message: 2 a DdpkitError (errors.install_one_line_errors) or
        # a usage error, 124 a hang, 74 a full disk, 65 a diverged loss.
        said = "traceback" if failure.exitcode == 1 or failure.exitcode < 0 else "message"
        code = (f"exit code {failure.exitcode}" if failure.exitcode >= 0 else
                f"then stopped by {signal.Signals(-failure.exitcode).name}")
        shown = ("not prefixed" if plain_rank0 and failure.local_rank == 0 else
                 f"prefixed {prefix}")
        what = f"failed first ({code}, pid {failure.pid}); its {said} is above, {shown}"
    print(f"ddpkit launch: rank {rank} {what}{also}", file=sys.stderr, flush=True)
    return exit_code(rank, failures)


def exit_code(rank: int, failures: dict) -> int:
    """The launch's exit code: the root cause's own. A cause the agent stopped while it
    wound down (it recorded its error, then SIGTERM came) never got to exit with its
    code, so take the code of a peer that raised by itself and exited (SPMD ranks meet
    the same mistake together: a usage error is 2 on every rank that reached it);
    1 without one."""
    failure = failures[rank]
    if failure.exitcode > 0:
        return failure.exitcode
    if _recorded(failure):
        for _, peer in sorted(failures.items()):
            if peer.exitcode > 0 and _recorded(peer) and not _lost_a_peer(peer):
                return peer.exitcode
    return 1
