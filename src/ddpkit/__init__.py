"""ddpkit: distributed data-parallel training on PyTorch.

Public API (stable names): World, init, shutdown, distributed, spawn, and, as they
land, DataParallel, join, Checkpointer and the comm/data subpackages.
"""

# ddpkit.log installs the library's NullHandler on import (handlers belong to the application).
from ddpkit import (
    comm,
    data,
    log,  # noqa: F401 - installs the library's NullHandler
)
from ddpkit.checkpoint import Checkpointer
from ddpkit.errors import CommError, ConfigError, DdpkitError
from ddpkit.parallel import DataParallel, join
from ddpkit.runtime import distributed, init, shutdown
from ddpkit.spawn import SpawnError, spawn
from ddpkit.topology import Topology
from ddpkit.world import World

__all__ = [
    "Checkpointer",
    "CommError",
    "ConfigError",
    "DataParallel",
    "DdpkitError",
    "SpawnError",
    "Topology",
    "World",
    "comm",
    "data",
    "distributed",
    "init",
    "join",
    "shutdown",
    "spawn",
]
__version__ = "0.1.0"
