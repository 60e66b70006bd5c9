"""How a flat tensor is cut among the ranks that each reduce one part of it.

One cut, used twice, which is why they agree: the shared-memory all-reduce has rank i
sum elements ``[b[i], b[i+1])`` of every message (:mod:`ddpkit.comm.shm`), and a
sharded DataParallel (ZeRO) gives rank i the same elements of every gradient bucket to
own. A reduce-scatter that keeps chunk i then adds exactly the numbers the all-reduce
adds, in the same order, so sharded training is bit for bit the unsharded one.
"""

from __future__ import annotations

ALIGN_BYTES = 64  # chunk boundaries on cache lines: no two ranks write one line


def chunk_bounds(numel: int, itemsize: int, parts: int) -> list[int]:
    """Where ``parts`` ranks split ``numel`` elements of ``itemsize`` bytes: rank i
    reduces (and owns) ``[b[i], b[i+1])``. Boundaries fall on cache lines, so no two
    ranks write one line; a rank's chunk may be empty when the tensor is small."""
    align = max(1, ALIGN_BYTES // itemsize)
    bounds = [min(numel, (numel * i // parts) // align * align) for i in range(parts)]
    return bounds + [numel]
