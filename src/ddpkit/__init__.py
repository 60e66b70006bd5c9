"""ddpkit: distributed data-parallel training on PyTorch.

Public API (stable names): World, init, shutdown, distributed, spawn, DataParallel,
join, Checkpointer, Run (your own loop with resume, preemption and hang detection),
patch_torch (torch's DistributedDataParallel and CPU collectives made ddpkit's), and
the subpackages comm, data, parallel, checkpoint, fault, loop and plan.

The names that need torch are imported on first use (PEP 562 ``__getattr__``):
``import ddpkit`` and the ``ddpkit`` command's launcher then start without importing
torch, which costs more than a second; ``ddpkit.DataParallel``, ``ddpkit.fault`` etc.
are there when a program first uses them.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# ddpkit.log installs the library's NullHandler on import (handlers belong to the application).
from ddpkit import log  # noqa: F401
from ddpkit.errors import (
    ONE_LINE_ERRORS_ENV,
    CommError,
    ConfigError,
    DdpkitError,
    install_one_line_errors,
)
from ddpkit.runtime.spawn import SpawnError, spawn
from ddpkit.runtime.topology import Topology
from ddpkit.runtime.world import World

if os.environ.get(ONE_LINE_ERRORS_ENV) == "1":  # a script under `ddpkit launch`
    install_one_line_errors()

# Public name -> the module that defines it, imported when the name is first used.
_LAZY = {
    "Checkpointer": "ddpkit.checkpoint",
    "DataParallel": "ddpkit.parallel",
    "join": "ddpkit.parallel",
    "Run": "ddpkit.loop",
    "distributed": "ddpkit.runtime.process_group",
    "init": "ddpkit.runtime.process_group",
    "shutdown": "ddpkit.runtime.process_group",
    "patch_torch": "ddpkit.parallel.compat.torch_swap",
}
_SUBPACKAGES = ("checkpoint", "comm", "data", "fault", "loop", "parallel", "plan")

if TYPE_CHECKING:
    from ddpkit import checkpoint, comm, data, fault, loop, parallel, plan
    from ddpkit.checkpoint import Checkpointer
    from ddpkit.loop import Run
    from ddpkit.parallel import DataParallel, join
    from ddpkit.parallel.compat.torch_swap import patch_torch
    from ddpkit.runtime.process_group import distributed, init, shutdown


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"ddpkit.{name}")
    else:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBPACKAGES})


__all__ = [
    "Checkpointer",
    "CommError",
    "ConfigError",
    "DataParallel",
    "DdpkitError",
    "Run",
    "SpawnError",
    "Topology",
    "World",
    "checkpoint",
    "comm",
    "data",
    "distributed",
    "fault",
    "init",
    "join",
    "loop",
    "parallel",
    "patch_torch",
    "plan",
    "shutdown",
    "spawn",
]
__version__ = "0.1.0"
