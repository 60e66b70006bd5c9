"""Fault injection for fault-tolerance tests; inert unless these variables are set.

``DDPKIT_TEST_KILL_AT_STEP=S:R``
    rank R sends itself SIGKILL right after optimizer step S (a crash no handler sees).
``DDPKIT_TEST_SLEEP_AT_STEP=S:R:SECONDS``
    rank R (``*``: every rank) sleeps SECONDS right after step S: a straggler, or a hang
    when SECONDS exceeds the collective timeout. A stop signal (preemption) cuts the
    sleep short, so a test can signal a run parked at a known step.
``DDPKIT_TEST_RAISE_AT_STEP=S:R``
    rank R raises a RuntimeError right after step S, as a bug in a training step would.

All act only in the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset): the
restarted workers of an elastic run must get past the step that failed. :class:`Run`
installs them, so ``ddpkit train`` and a user's own loop answer to the same variables.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping

from ddpkit.errors import ConfigError

KILL = "DDPKIT_TEST_KILL_AT_STEP"
SLEEP = "DDPKIT_TEST_SLEEP_AT_STEP"
RAISE = "DDPKIT_TEST_RAISE_AT_STEP"

StepHook = Callable[[int], None]  # called with the number of the step just finished


def _parse(name: str, value: str, parts: int) -> list[str]:
    fields = value.split(":")
    if len(fields) != parts or not fields[0].isdigit():
        shape = "STEP:RANK" if parts == 2 else "STEP:RANK:SECONDS"
        raise ConfigError(f"{name}={value!r} is not {shape}")
    return fields


def step_hooks(env: Mapping[str, str], rank: int, restart_count: int,
               stop_requested: Callable[[], bool]) -> list[StepHook]:
    """The faults ``env`` asks of this rank, as hooks to call after every step."""
    if restart_count > 0:
        return []
    hooks: list[StepHook] = []
    if KILL in env:
        step, who = _parse(KILL, env[KILL], 2)
        if who == str(rank):
            def kill(done: int, at: int = int(step)) -> None:
                if done == at:
                    os.kill(os.getpid(), signal.SIGKILL)

            hooks.append(kill)
    if SLEEP in env:
        step, who, seconds = _parse(SLEEP, env[SLEEP], 3)
        if who in ("*", str(rank)):
            def sleep(done: int, at: int = int(step), for_s: float = float(seconds)) -> None:
                if done != at:
                    return
                end = time.monotonic() + for_s
                while time.monotonic() < end and not stop_requested():
                    time.sleep(0.05)

            hooks.append(sleep)
    step, _, who = env.get(RAISE, "").partition(":")
    if step.isdigit() and who == str(rank):
        def fail(done: int, at: int = int(step)) -> None:
            if done == at:
                raise RuntimeError(f"injected failure at step {at} ({RAISE})")

        hooks.append(fail)
    return hooks
