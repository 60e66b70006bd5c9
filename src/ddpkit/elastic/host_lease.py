"""A host's lease on its membership in an elastic job: renewed by every successful
contact with the rendezvous backend, expired after ``duration`` seconds without one.

The other hosts declare a silent host dead once its heartbeat is older than torch's
``keep_alive_interval * keep_alive_max_attempt``, and then continue without it. A host
cut off the network cannot hear that: its workers are blocked in a collective (or,
worse, in the middle of writing a checkpoint) and would stay so until some timeout. The
lease is its own side of the same clock: it expires about when the others give up on
the host (``ddpkit.elastic.membership`` sets half a keep-alive interval less than their limit,
counted from the last contact rather than the last heartbeat), and its expiry stops the
host's workers at once. The others still have to meet again (a last call of seconds)
and start new workers before anything of theirs touches the run, so nothing of the lost
host is left by then.

A watcher thread checks the lease; the expiry callback runs on it, once per arming.
Torch-free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Lease:
    """``arm()`` when work starts that must stop if contact is lost, ``renew()`` after
    each contact, ``disarm()`` when that work is over. ``on_expiry(silent_seconds)``
    runs on the watcher thread."""

    def __init__(self, duration: float, on_expiry: Callable[[float], None],
                 poll: float = 0.1):
        self.duration = duration
        self._on_expiry = on_expiry
        self._poll = poll
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._armed = False
        self._expired = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def expired(self) -> bool:
        return self._expired

    def arm(self) -> None:
        with self._lock:
            self._last = time.monotonic()
            self._armed = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="ddpkit-host-lease",
                                            daemon=True)
            self._thread.start()

    def renew(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    def disarm(self) -> None:
        with self._lock:
            self._armed = False

    def close(self) -> None:
        self.disarm()
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(self._poll):
            with self._lock:
                silent = time.monotonic() - self._last
                due = self._armed and silent > self.duration
                if due:
                    self._armed = False
                    self._expired = True
            if due:
                self._on_expiry(silent)
