"""Fault injection for the fault-tolerance tests; inert unless these variables are set.

``DDPKIT_TEST_KILL_AT_STEP=S:R``
    rank R sends itself SIGKILL right after optimizer step S (a crash no handler sees).
``DDPKIT_TEST_SLEEP_AT_STEP=S:R:SECONDS``
    rank R (``*``: every rank) sleeps SECONDS right after step S: a straggler, or a hang
    when SECONDS exceeds ``--collective-timeout``. A stop signal (preemption) cuts the
    sleep short, so a test can signal a run parked at a known step.

Both act only in the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset): the
restarted workers of an elastic run must get past the step that failed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ddpkit.errors import ConfigError

if TYPE_CHECKING:
    from ddpkit.train.trainer import Trainer

KILL = "DDPKIT_TEST_KILL_AT_STEP"
SLEEP = "DDPKIT_TEST_SLEEP_AT_STEP"


def _parse(name: str, value: str, parts: int) -> list[str]:
    fields = value.split(":")
    if len(fields) != parts or not fields[0].isdigit():
        shape = "STEP:RANK" if parts == 2 else "STEP:RANK:SECONDS"
        raise ConfigError(f"{name}={value!r} is not {shape}")
    return fields


def install(trainer: Trainer, env: Mapping[str, str], restart_count: int) -> None:
    """Add the requested faults to ``trainer.step_callbacks``."""
    if restart_count > 0:
        return
    rank = trainer.world.rank
    if KILL in env:
        step, who = _parse(KILL, env[KILL], 2)
        if who == str(rank):
            def kill(t: Trainer, at: int = int(step)) -> None:
                if t.loop.step == at:
                    os.kill(os.getpid(), signal.SIGKILL)

            trainer.step_callbacks.append(kill)
    if SLEEP in env:
        step, who, seconds = _parse(SLEEP, env[SLEEP], 3)
        if who in ("*", str(rank)):
            def sleep(t: Trainer, at: int = int(step), for_s: float = float(seconds)) -> None:
                if t.loop.step != at:
                    return
                end = time.monotonic() + for_s
                while time.monotonic() < end and not t.preemption.requested:
                    time.sleep(0.05)

            trainer.step_callbacks.append(sleep)
