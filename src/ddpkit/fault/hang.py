"""Hangs become errors that name the rank that did not arrive.

A collective waits for every rank. When one rank is stuck (a deadlock, a dead data
loader, a rank that skipped a collective behind an ``if``), the others block, and the
backend's timeout, if it fires at all, says only that a ``recv`` timed out. To say
*who* is missing, each rank publishes its position — a sequence number, the step and
the name of the point it reached — to the job's c10d store. One ``store.set`` on a
TCPStore is cheap enough to do at every step (benchmarks/RESULTS-history.md, fault tolerance,
has its cost). When a wait times
out, the waiting rank reads everyone's position and reports the ranks that are behind.

Three ways to wait, from cheapest to most general:

* :meth:`Watchdog.barrier` — a store-only barrier with its own timeout. It never
  touches the process group, so a timeout leaves the group usable.
* :meth:`Watchdog.guard` — wraps any block (a backward with DDP's all-reduces, a
  metric all-reduce). When the backend's own timeout (``ddpkit.init(timeout=...)``;
  give the watchdog the same value) raises inside the block, the error is rewritten
  into a :class:`HangError` naming the missing ranks. A backstop thread covers backends
  that never raise: past ``timeout + grace`` it logs the diagnosis and, with
  ``exit_on_hang``, ends the process with :data:`EXIT_HANG` so an elastic agent can
  restart the job from its last checkpoint.
* :meth:`Watchdog.stragglers` — who is behind right now, for logs and dashboards.

All ranks must publish the same sequence of points (true of SPMD training loops).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ddpkit.errors import ConfigError, DdpkitError
from ddpkit.exit_codes import EXIT_HANG
from ddpkit.log import get_logger

log = get_logger(__name__)

# Exit status of a process the backstop thread ends: the conventional "timed out".
_TIMEOUT_WORDS = ("timed out", "timeout", "connection", "closed", "reset by peer", "broken pipe")
_PEER_LOST_WORDS = ("closed by peer", "reset by peer", "broken pipe", "connection closed")
# While a guard is armed the backstop thread wakes every TICK_S and stamps a heartbeat.
# A gap between its wake-ups longer than TICK_S + FROZEN_SLACK_S means the whole process
# was not running (SIGSTOP, a suspended machine); a peer's heartbeat older than
# STALE_BEAT_S says the same about that peer.
TICK_S = 1.0
FROZEN_SLACK_S = 2.0
STALE_BEAT_S = TICK_S + FROZEN_SLACK_S


def _short(cause: str) -> str:
    """The backend's words without its source location and advice sentences."""
    cause = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", cause.strip())
    return cause.split(". ")[0]


class HangError(DdpkitError, RuntimeError):
    """A collective did not complete in time; the message names the missing ranks."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class RankProgress:
    """The last point a rank published. ``seq`` is -1 for a rank that never published."""

    rank: int
    seq: int
    step: int
    name: str
    age_s: float | None

    def describe(self) -> str:
        if self.seq < 0:
            return f"rank {self.rank} (never reported progress)"
        return f"rank {self.rank} (last at step {self.step} {self.name!r}, {self.age_s:.1f} s ago)"


class ProgressBoard:
    """Each rank's latest (seq, step, name, time) under ``prefix`` in a c10d store."""

    def __init__(
        self,
        store: dist.Store | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        prefix: str = "ddpkit/progress",
    ):
        if store is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError("ProgressBoard needs a store or an initialized process group")
            store = dist.distributed_c10d._get_default_store()
        self.store = store
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.prefix = prefix
        self.seq = -1

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/rank{rank}"

    def publish(self, step: int, name: str) -> int:
        """Record that this rank reached point ``name`` of ``step``; returns its seq."""
        self.seq += 1
        self.store.set(self._key(self.rank), f"{self.seq}|{step}|{time.time():.3f}|{name}")
        return self.seq

    def read(self) -> list[RankProgress]:
        now = time.time()
        out = []
        for rank in range(self.world_size):
            key = self._key(rank)
            # get() on a missing key would block for the store's timeout; check first.
            if not self.store.check([key]):
                out.append(RankProgress(rank, -1, -1, "", None))
                continue
            seq, step, stamp, name = self.store.get(key).decode().split("|", 3)
            age = max(now - float(stamp), 0.0)  # clocks of other hosts may run slightly ahead
            out.append(RankProgress(rank, int(seq), int(step), name, age))
        return out

    def beat(self) -> None:
        """Stamp this rank's heartbeat (its process is running)."""
        self.store.set(f"{self.prefix}/beat{self.rank}", f"{time.time():.3f}")

    def stale(self) -> list[tuple[int, float]]:
        """Peers whose heartbeat is older than :data:`STALE_BEAT_S` (their process stopped
        running while in a guarded section): (rank, age)."""
        now, out = time.time(), []
        for rank in range(self.world_size):
            key = f"{self.prefix}/beat{rank}"
            if rank == self.rank or not self.store.check([key]):
                continue
            age = now - float(self.store.get(key).decode())
            if age > STALE_BEAT_S:
                out.append((rank, age))
        return out

    def behind(self, seq: int | None = None) -> list[RankProgress]:
        """Ranks that have not reached point ``seq`` (default: this rank's latest)."""
        seq = self.seq if seq is None else seq
        return [p for p in self.read() if p.seq < seq]


def set_collective_timeout(seconds: float, group: dist.ProcessGroup | None = None) -> None:
    """Change how long the backend lets one collective of ``group`` wait (gloo, nccl).

    ``init_process_group``'s timeout also bounds the rendezvous, where ranks may start
    seconds apart (each imports torch first): initialise with a generous timeout, then
    tighten it for the training loop with this. Uses torch's ``_set_pg_timeout``.
    """
    if seconds <= 0:
        raise ConfigError(f"collective timeout must be positive, got {seconds} s")
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:  # older torch: the watchdog's backstop thread still ends a hang
        log.warning_once("this torch cannot change a process group's timeout after init")
        return
    setter(timedelta(seconds=seconds), group)


class Watchdog:
    """Collective timeouts that name the missing ranks. Create on every rank.

    ``timeout``: seconds a wait may take; a rank slower than its peers but within it is
    fine. ``grace``: extra seconds the backstop thread allows a guarded block after
    ``timeout`` before declaring a hang the backend did not report. ``exit_on_hang``:
    the backstop thread then ends the process with :data:`EXIT_HANG` (a thread cannot
    interrupt a rank blocked inside a C++ collective); otherwise it only logs.
    """

    def __init__(
        self,
        timeout: float,
        *,
        board: ProgressBoard | None = None,
        grace: float | None = None,
        exit_on_hang: bool = True,
    ):
        if timeout <= 0:
            raise ConfigError(f"collective timeout must be positive, got {timeout} s")
        self.timeout = float(timeout)
        self.grace = max(5.0, 0.5 * self.timeout) if grace is None else float(grace)
        self.board = board or ProgressBoard()
        self.exit_on_hang = exit_on_hang
        self._barriers = 0
        self._armed: tuple[float, int, int, str] | None = None  # deadline, seq, step, name
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ progress
    def progress(self, step: int, name: str) -> None:
        """Publish this rank's position without waiting for anyone."""
        self.board.publish(step, name)

    def stragglers(self) -> list[RankProgress]:
        return self.board.behind()

    def _error(self, step: int, name: str, seq: int, waited: float, cause: str = "") -> HangError:
        try:
            late = self.board.behind(seq)
        except (RuntimeError, dist.DistError) as err:
            # The store itself is gone (its host, often rank 0, died): nobody to name.
            message = (
                f"rank {self.board.rank}: {name!r} at step {step} failed and the job's store "
                f"is unreachable ({_short(str(err))}); the rank hosting it (usually rank 0) "
                "probably died first (see its error)"
            )
            if cause:
                message += f" [backend: {_short(cause)}]"
            return HangError(message, [])
        lost = any(w in cause.lower() for w in _PEER_LOST_WORDS)
        who = "; ".join(p.describe() for p in late)
        if late and lost:
            message = (
                f"rank {self.board.rank} lost its connection at step {step} {name!r} to {who}: "
                "that rank died or failed first (see its own error)"
            )
        elif late:
            message = (
                f"rank {self.board.rank} waited {waited:.1f} s at step {step} {name!r} "
                f"(timeout {self.timeout:g} s) for {who}"
            )
        elif lost:
            # Every rank reached the point and a peer then hung up: that peer failed
            # first (its own error names the cause); this rank is collateral.
            message = (
                f"rank {self.board.rank}: {name!r} at step {step} lost its connection to a "
                "peer that had reached it too (that peer failed first; see its error)"
            )
        elif stale := self.board.stale():  # every rank reached it
            who = ", ".join(f"rank {r} (no heartbeat for {age:.0f} s)" for r, age in stale)
            message = (
                f"rank {self.board.rank}: {name!r} at step {step} did not complete within "
                f"{self.timeout:g} s: {who} reached it, then stopped running (stopped, e.g. "
                "by SIGSTOP, or its machine frozen)"
            )
        else:
            message = (
                f"rank {self.board.rank}: {name!r} at step {step} did not complete within "
                f"{self.timeout:g} s although every rank reached it (network or backend stall)"
            )
        if cause:
            message += f" [backend: {_short(cause)}]"
        return HangError(message, [p.rank for p in late])

    # ------------------------------------------------------------------ barrier
    def barrier(self, step: int, name: str = "barrier", timeout: float | None = None) -> None:
        """A barrier through the store that raises :class:`HangError` after ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        seq = self.board.publish(step, name)
        index = self._barriers
        self._barriers += 1
        store, prefix = self.board.store, f"{self.board.prefix}/barrier"
        arrived = store.add(f"{prefix}/{index}", 1)
        start = time.monotonic()
        if arrived == self.board.world_size:
            store.set(f"{prefix}/{index}/done", "1")
            if index > 0:  # everyone has left the previous barrier: drop its keys
                store.delete_key(f"{prefix}/{index - 1}")
                store.delete_key(f"{prefix}/{index - 1}/done")
            return
        try:
            store.wait([f"{prefix}/{index}/done"], timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as err:  # DistStoreError on timeout
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise self._error(step, name, seq, time.monotonic() - start, first) from None

    # ------------------------------------------------------------------ guard
    @contextlib.contextmanager
    def guard(self, step: int, name: str) -> Iterator[None]:
        """Run a block that waits on other ranks; a backend timeout or lost peer inside
        it becomes a :class:`HangError` naming the ranks that are behind."""
        seq = self.board.publish(step, name)
        start = time.monotonic()
        self._arm((start + self.timeout + self.grace, seq, step, name))
        try:
            yield
        except RuntimeError as err:
            text = str(err).strip()
            if isinstance(err, HangError) or not any(w in text.lower() for w in _TIMEOUT_WORDS):
                raise
            first = text.splitlines()[0] if text else type(err).__name__
            raise self._error(step, name, seq, time.monotonic() - start, first) from err
        finally:
            self._arm(None)

    def _arm(self, armed: tuple[float, int, int, str] | None) -> None:
        with self._cond:
            self._armed = armed
            if armed is not None and self._thread is None:
                self._thread = threading.Thread(
                    target=self._backstop, name="ddpkit-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _backstop(self) -> None:
        frozen_s, last = 0.0, time.monotonic()  # time this process did not run, armed
        beaten = -TICK_S  # when the last heartbeat went out (at most one per tick: a
        # guard is armed several times per step, and a store write per arm would cost)
        with self._cond:
            while not self._closed:
                if self._armed is None:
                    frozen_s = 0.0
                    self._cond.wait()
                    last = time.monotonic()
                    continue
                now = time.monotonic()
                if now - last > TICK_S + FROZEN_SLACK_S:
                    frozen_s += now - last - TICK_S
                last = now
                deadline, seq, step, name = self._armed
                left = deadline - now
                if left > 0:
                    if now - beaten >= TICK_S:
                        self._beat()
                        beaten = now
                    self._cond.wait(min(left, TICK_S))
                    continue
                if frozen_s > 0:
                    # Its peers waited for this process, not it for them.
                    message = (f"rank {self.board.rank}: this process was not running for "
                               f"{frozen_s:.0f} s (stopped, e.g. by SIGSTOP, or its machine "
                               f"suspended) during {name!r} at step {step}; its peers gave "
                               "up waiting for it")
                else:
                    message = str(self._error(step, name, seq, self.timeout + self.grace,
                                              "no error from backend"))
                log.error(f"hang: {message}", all_ranks=True)
                if self.exit_on_hang:
                    os._exit(EXIT_HANG)
                self._armed, frozen_s = None, 0.0

    def _beat(self) -> None:
        # A store that is gone: the guard's own error says so.
        with contextlib.suppress(RuntimeError, dist.DistError):
            self.board.beat()

    def close(self) -> None:
        """Stop the backstop thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._armed = None
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
