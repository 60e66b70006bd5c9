"""ddpkit.comm: collectives with a choice of algorithm, on torch.distributed.

``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``reduce`` and
``barrier`` take torch's arguments plus ``algo=``: "auto" (the default: "shm" for CPU
tensors on one host, "hierarchical" across hosts, "backend" for CUDA tensors; see
:mod:`ddpkit.comm.auto`), "ring" (our segmented ring on point-to-point), "naive_ring"
(the tutorial's unsegmented one), "backend" (torch's own collective), "shm",
"hierarchical", or any name added with :func:`register_algorithm`. See
docs/collectives.md.

Also public, for the layers above (the DDP engine) and for users: :func:`chunk_bounds`
(the cut of a flat tensor among ranks that the shared-memory all-reduce sums by, and
ZeRO's shards follow), the modules :mod:`ddpkit.comm.auto` (what "auto" chooses) and the
package :mod:`ddpkit.comm.shm` (the shared-memory communicator and its comm hook).
"""

from ddpkit.comm import auto, shm
from ddpkit.comm.backend import BackendAlgorithm
from ddpkit.comm.chunks import chunk_bounds
from ddpkit.comm.collectives import (
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    reduce,
    reduce_scatter,
)
from ddpkit.comm.lanes import CommHandle, close_lanes, new_group
from ddpkit.comm.ops import OPS
from ddpkit.comm.registry import (
    algorithms,
    get_algorithm,
    register_algorithm,
    unregister_algorithm,
)
from ddpkit.comm.ring import RingAlgorithm

__all__ = [
    "OPS",
    "BackendAlgorithm",
    "CommHandle",
    "RingAlgorithm",
    "algorithms",
    "all_gather",
    "all_reduce",
    "barrier",
    "auto",
    "broadcast",
    "chunk_bounds",
    "close_lanes",
    "get_algorithm",
    "new_group",
    "reduce",
    "reduce_scatter",
    "register_algorithm",
    "shm",
    "unregister_algorithm",
]
