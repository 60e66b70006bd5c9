"""Fault injection for the fault-tolerance tests; inert unless these variables are set.

``DDPKIT_TEST_KILL_AT_STEP=S:R`` and ``DDPKIT_TEST_SLEEP_AT_STEP=S:R:SECONDS``, read
by :func:`ddpkit.loop.inject.step_hooks` (one implementation for ``ddpkit train`` and
a user's own loop on :class:`ddpkit.Run`); here they become ``step_callbacks``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ddpkit.loop.inject import KILL, SLEEP, step_hooks

if TYPE_CHECKING:
    from ddpkit.train.trainer import Trainer

__all__ = ["KILL", "SLEEP", "install"]


def install(trainer: Trainer, env: Mapping[str, str], restart_count: int) -> None:
    """Add the requested faults to ``trainer.step_callbacks``."""
    hooks = step_hooks(env, trainer.world.rank, restart_count,
                       lambda: trainer.preemption.requested)
    for hook in hooks:
        trainer.step_callbacks.append(lambda t, hook=hook: hook(t.loop.step))
