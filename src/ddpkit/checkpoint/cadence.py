"""When a checkpoint is due: by step count and/or by time since the last save."""

from __future__ import annotations

from time import monotonic  # a name of its own: tests move this clock alone

from ddpkit.checkpoint.store import CheckpointError


class Cadence:
    """When a checkpoint is due: every ``every_steps`` steps and/or ``every_seconds``.

    The step rule gives the same answer on every rank; the time rule reads this rank's
    clock, so pass its answer through an agreement (``PreemptionGuard.check(step,
    save_due=cadence.due(step))``) before acting on it.
    """

    def __init__(self, every_steps: int | None = None, every_seconds: float | None = None):
        if every_steps is not None and every_steps < 1:
            raise CheckpointError(f"checkpoint every_steps must be >= 1, got {every_steps}")
        if every_seconds is not None and every_seconds <= 0:
            raise CheckpointError(f"checkpoint every_seconds must be > 0, got {every_seconds}")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._last = monotonic()

    def due(self, step: int) -> bool:
        by_steps = self.every_steps is not None and step > 0 and step % self.every_steps == 0
        by_time = (
            self.every_seconds is not None and monotonic() - self._last >= self.every_seconds
        )
        return by_steps or by_time

    def saved(self) -> None:
        """Call after each save: the time rule counts from the last save."""
        self._last = monotonic()
