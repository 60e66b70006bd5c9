"""A training job's side of an elastic launch (``ddpkit.elastic.host_change``): the change line
once the workers have resumed, the step note while they train.

``DDPKIT_TEST_SLEEP_IN_ROUND=ROUND:STEP:SECONDS`` (tests only, inert unless set): the
workers of group ROUND of the job sleep SECONDS after STEP, cut short by a stop
signal, as ``DDPKIT_TEST_SLEEP_AT_STEP`` does in a first attempt; it parks a later group
at a known step, so that a test can add a host there.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from ddpkit.elastic.host_change import (
    CHANGE_ENV,
    FINISHED,
    STEP_NOTE_ENV,
    STOPPED,
    StepNote,
    change_line,
    group_round,
)
from ddpkit.loop.inject import SLEEP, step_hooks

if TYPE_CHECKING:
    from ddpkit.train.trainer import Trainer

SLEEP_IN_ROUND = "DDPKIT_TEST_SLEEP_IN_ROUND"


@contextlib.contextmanager
def reporting(trainer: Trainer, env: Mapping[str, str]) -> Iterator[None]:
    """Around a (resumed) trainer's ``fit()``."""
    local_rank0 = env.get("LOCAL_RANK", "0") == "0"
    change = env.get(CHANGE_ENV)
    if change and local_rank0:
        line = change_line(json.loads(change), trainer.run.step)
        print(f"ddpkit train: {line}", file=sys.stderr, flush=True)
    _park_this_round(trainer, env)
    path = env.get(STEP_NOTE_ENV)
    if not (path and local_rank0):
        yield
        return
    note = StepNote(path)
    note.write(trainer.run.step)
    # First: the note says a step is done before any other callback acts on it.
    trainer.step_callbacks.insert(0, lambda t: note.write(t.run.step))
    try:
        yield
        note.write(trainer.run.step, STOPPED if trainer.preempted else FINISHED)
    finally:
        note.close()


def _park_this_round(trainer: Trainer, env: Mapping[str, str]) -> None:
    fields = env.get(SLEEP_IN_ROUND, "").split(":")
    if len(fields) != 3 or not fields[0].isdigit() or int(fields[0]) != group_round(env):
        return
    step, seconds = fields[1:]
    for hook in step_hooks({SLEEP: f"{step}:*:{seconds}"}, trainer.world.rank, 0,
                           lambda: trainer.preemption.requested):
        trainer.step_callbacks.append(lambda t, hook=hook: hook(t.run.step))
