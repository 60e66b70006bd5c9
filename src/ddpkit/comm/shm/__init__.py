"""Shared-memory all-reduce for ranks on one host (see docs/shm.md).

Modules: ``communicator`` (set-up, shared allocations, the check of every call),
``shm_collectives`` (all-reduce and the other collectives on one host), ``hierarchical``
(the same across hosts), ``signature`` (the word each call is checked by), ``algorithm``
(the registry's "shm" algorithm and auto's choice of it), ``segment`` (POSIX
shared-memory files), ``sync`` (barriers over a control block) and ``hook`` (the
DataParallel / torch DDP comm hook). The names users need are re-exported here.
"""

from ddpkit.comm.shm import segment, sync
from ddpkit.comm.shm.algorithm import (
    backend_all_reduce,
    group_communicator,
    supports,
)
from ddpkit.comm.shm.communicator import (
    DEFAULT_SLOT_MB,
    DEFAULT_TIMEOUT_S,
    ShmCommunicator,
    host_key,
    run_id,
)
from ddpkit.comm.shm.hook import ShmState, shm_hook

__all__ = [
    "DEFAULT_SLOT_MB",
    "DEFAULT_TIMEOUT_S",
    "ShmCommunicator",
    "ShmState",
    "backend_all_reduce",
    "group_communicator",
    "host_key",
    "run_id",
    "segment",
    "shm_hook",
    "supports",
    "sync",
]
