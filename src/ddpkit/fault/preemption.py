"""Preemption: a signal becomes an orderly, agreed stop at a step boundary.

Schedulers announce the end of an allocation with a signal (SLURM: SIGTERM, or SIGUSR1
ahead of time with ``--signal=USR1@120``; torchrun forwards SIGTERM to its workers),
and often to only some of the processes. A handler that stopped just its own rank
would leave the others waiting in the next collective. Here the handler only sets a
flag; at each step boundary :meth:`PreemptionGuard.should_stop` all-reduces the flag
(MAX), so every rank sees the same answer at the same step, writes the checkpoint and
exits together.

Exit codes: a worker that stopped for preemption should *return normally* (exit 0):
under torchrun's elastic agent a non-zero exit counts as a failure and triggers a
restart on an allocation that is going away. The launching command reports the
preemption instead, with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: "try again
later"), which a batch script can turn into ``scontrol requeue``. The checkpoint's
manifest says ``reason: preempted``, which is how that command finds out.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger

log = get_logger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionGuard:
    """``with PreemptionGuard() as guard:`` ... ``if guard.should_stop(): save; break``.

    Installs handlers for ``signals`` on entry (main thread only; Python delivers
    signals there) and restores the previous handlers on exit. ``should_stop()`` is a
    collective: call it on every rank at the same points. A second signal while a stop
    is pending is only logged: the checkpoint in progress is worth finishing.
    """

    def __init__(
        self,
        signals: tuple[int, ...] = DEFAULT_SIGNALS,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        check_every: int = 1,
    ):
        if check_every < 1:
            raise ConfigError(f"check_every must be >= 1, got {check_every}")
        self.signals = tuple(signals)
        self.check_every = check_every
        self.group = group
        self._device = device
        self._received: int | None = None
        self._previous: dict[int, object] = {}
        self.stopped_by: int | None = None  # rank-agreed result of the last should_stop

    # ---------------------------------------------------------------- handlers
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._received is None:
            self._received = signum
        # Logging from a signal handler can deadlock on the handler's lock; keep it to
        # a flag and report at the next step boundary.

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard must be entered in the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    # ---------------------------------------------------------------- queries
    @property
    def requested(self) -> bool:
        """Whether *this* rank received a signal (local, no communication)."""
        return self._received is not None

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop as if ``signum`` arrived (for tests and manual stops)."""
        self._handle(signum, None)

    def _flag_device(self) -> torch.device:
        if self._device is not None:
            return torch.device(self._device)
        from ddpkit.checkpoint import local_device

        return local_device()

    def should_stop(self, step: int | None = None) -> bool:
        """Collective: True on every rank if any rank received a stop signal.

        With ``check_every=N`` and a ``step``, only steps divisible by N communicate (a
        tiny all-reduce costs a network round trip; on slow links, check less often).
        """
        return self.check(step)[0]

    def check(self, step: int | None = None, *, save_due: bool = False) -> tuple[bool, bool]:
        """Collective: ``(stop, save)`` agreed by every rank in one all-reduce.

        ``save_due``: this rank thinks a checkpoint is due (e.g. a time-based cadence
        read from its own clock); if any rank does, every rank gets ``save=True``, so a
        time-based cadence cannot split the ranks. On a step that ``check_every`` skips
        nothing is exchanged and ``(False, False)`` comes back (unless already stopped).
        """
        if self.stopped_by is not None:
            return True, False
        if step is not None and step % self.check_every:
            return False, False
        local = 0 if self._received is None else int(self._received)
        if not (dist.is_available() and dist.is_initialized()):
            agreed, save = local, bool(save_due)
        else:
            # MAX: any rank's signal stops all, and the value says which signal it was.
            flags = torch.tensor([local, int(save_due)], dtype=torch.int32,
                                 device=self._flag_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            agreed, save = int(flags[0].item()), bool(flags[1].item())
        if agreed:
            self.stopped_by = agreed
            who = "this rank" if local else "another rank"
            log.warning(
                f"preemption: {signal.Signals(agreed).name} received by {who}; "
                "stopping at this step boundary",
            )
        return bool(agreed), save
