"""Fault tolerance pieces the trainer composes: hang detection and preemption.

Checkpointing lives in :mod:`ddpkit.checkpoint`; restarts after a dead worker come
from torchrun's elastic agent (``ddpkit launch --max-restarts``).
"""

from ddpkit.exit_codes import EXIT_HANG, EXIT_PREEMPTED
from ddpkit.fault.hang import (
    HangError,
    ProgressBoard,
    RankProgress,
    Watchdog,
    set_collective_timeout,
)
from ddpkit.fault.preemption import DEFAULT_SIGNALS, PreemptionGuard

__all__ = [
    "DEFAULT_SIGNALS",
    "EXIT_HANG",
    "EXIT_PREEMPTED",
    "HangError",
    "PreemptionGuard",
    "ProgressBoard",
    "RankProgress",
    "Watchdog",
    "set_collective_timeout",
]
