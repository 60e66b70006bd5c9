"""The workers' side of an elastic job's membership: where training stands, and one line
when the hosts changed.

Between the launcher (torchrun's agent with ddpkit's rendezvous, ``ddpkit.elastic.membership``)
and the workers it starts on one host:

* **The step note.** The launcher names a small file in :data:`STEP_NOTE_ENV`; local
  rank 0 writes the last step it finished there after every step, and at the end
  whether the job finished or was stopped (a checkpoint to continue from). The
  launcher reads it: to say after which step a host was lost, and to tell a finished
  job (its workers may then fail to say goodbye to a peer that died) from workers
  stopped so that the hosts can meet again.
* **The change line.** When the hosts of the job changed, the launcher describes the
  change in :data:`CHANGE_ENV` for the next workers; once they have resumed, local rank
  0 of every host prints one line: ``host 10.0.0.3 lost after step 1005; continuing
  on 2 hosts from step 990``.

This module is the protocol (names, the note's format, the line); the training
application's side is ``ddpkit.train.host_report``. Torch-free.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

from ddpkit.elastic.writer_fence import generation
from ddpkit.exit_codes import EXIT_PEER_LOST

STEP_NOTE_ENV = "DDPKIT_STEP_NOTE"  # path of this host's step note (set by the launcher)
CHANGE_ENV = "DDPKIT_HOSTS_CHANGE"  # JSON: lost, joined, hosts, after_step
RUNNING, FINISHED, STOPPED = 0, 1, 2
# A worker whose peer was lost (EX_PROTOCOL): its launcher says what happened, and waits
# for the change of hosts instead of counting a failure.
_NOTE = struct.Struct("<qq")  # (step, status)
# How a collective says that the process at the other end is gone (gloo, ddpkit's watchdog).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "lost its connection")


def group_round(env: Mapping[str, str]) -> int:
    """Which group of an elastic job this is (0: the first); 0 outside one. A later group
    continues from the run's newest checkpoint, on every host alike, also on a host that
    has just joined."""
    found = generation(dict(env))
    return found[1] if found else 0


def quiet_if_peer_lost(body: Callable[[], int]) -> int:
    """``body()``; in an elastic job (the launcher named a step note), an error that only
    says a peer is gone ends this worker quietly with :data:`EXIT_PEER_LOST`: its
    launcher reports the change of hosts in one line, not every rank its traceback."""
    try:
        return body()
    except Exception as err:
        if STEP_NOTE_ENV in os.environ and any(p in str(err) for p in _PEER_GONE):
            return EXIT_PEER_LOST
        raise


def read_note(path: str) -> tuple[int, int] | None:
    """(step, status) from a step note, or None when nothing was written yet."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(_NOTE.size)
    except OSError:
        return None
    return _NOTE.unpack(data) if len(data) == _NOTE.size else None


class StepNote:
    """Local rank 0's side of the note: one ``pwrite`` of 16 bytes per step."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)

    def write(self, step: int, status: int = RUNNING) -> None:
        os.pwrite(self._fd, _NOTE.pack(step, status), 0)

    def close(self) -> None:
        os.close(self._fd)


def change_line(change: Mapping[str, Any], resumed_step: int) -> str:
    """The one line for a change of hosts (``change`` as in :data:`CHANGE_ENV`)."""
    parts = []
    for key in ("lost", "joined"):
        hosts = change.get(key) or []
        if hosts:
            word = "host" if len(hosts) == 1 else "hosts"
            parts.append(f"{word} {', '.join(hosts)} {key}")
    after = change.get("after_step")
    when = f" after step {after}" if after is not None else ""
    count = change.get("hosts")
    return (f"{' and '.join(parts)}{when}; continuing on {count} "
            f"host{'s' if count != 1 else ''} from step {resumed_step}")
