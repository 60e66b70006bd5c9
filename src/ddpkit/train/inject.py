"""Fault injection for the fault-tolerance tests; inert unless these variables are set.

``DDPKIT_TEST_KILL_AT_STEP=S:R`` and ``DDPKIT_TEST_SLEEP_AT_STEP=S:R:SECONDS``, read
by :func:`ddpkit.loop.inject.step_hooks` (one implementation for ``ddpkit train`` and
a user's own loop on :class:`ddpkit.Run`); here they become ``step_callbacks``.
``DDPKIT_TEST_RAISE_AT_STEP=S:R``: rank R raises a RuntimeError right after step S, as
a bug in a training step would (first attempt only, like the others).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ddpkit.loop.inject import KILL, SLEEP, step_hooks

if TYPE_CHECKING:
    from ddpkit.train.trainer import Trainer

__all__ = ["KILL", "RAISE", "SLEEP", "install"]

RAISE = "DDPKIT_TEST_RAISE_AT_STEP"


def install(trainer: Trainer, env: Mapping[str, str], restart_count: int) -> None:
    """Add the requested faults to ``trainer.step_callbacks``."""
    hooks = step_hooks(env, trainer.world.rank, restart_count,
                       lambda: trainer.preemption.requested)
    for hook in hooks:
        trainer.step_callbacks.append(lambda t, hook=hook: hook(t.loop.step))
    step, _, rank = env.get(RAISE, "").partition(":")
    if step.isdigit() and rank == str(trainer.world.rank) and restart_count == 0:
        def fail(t: Trainer, at: int = int(step)) -> None:
            if t.loop.step == at:
                raise RuntimeError(f"injected failure at step {at} ({RAISE})")

        trainer.step_callbacks.append(fail)
