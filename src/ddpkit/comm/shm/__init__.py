"""Shared-memory all-reduce for ranks on one host (see docs/shm.md).

Modules: ``allreduce`` (the communicator and the "shm" algorithm), ``segment`` (POSIX
shared-memory files), ``sync`` (barriers over a control block) and ``hook`` (the
DataParallel / torch DDP comm hook). The names users need are re-exported here.
"""

from ddpkit.comm.shm import segment, sync
from ddpkit.comm.shm.allreduce import (
    DEFAULT_SLOT_MB,
    DEFAULT_TIMEOUT_S,
    ShmCommunicator,
    all_reduce,
    backend_all_reduce,
    communicator,
    host_key,
    run_id,
    supports,
)
from ddpkit.comm.shm.hook import ShmState, shm_hook

__all__ = [
    "DEFAULT_SLOT_MB",
    "DEFAULT_TIMEOUT_S",
    "ShmCommunicator",
    "ShmState",
    "all_reduce",
    "backend_all_reduce",
    "communicator",
    "host_key",
    "run_id",
    "segment",
    "shm_hook",
    "supports",
    "sync",
]
