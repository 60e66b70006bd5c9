"""Which part of every gradient bucket each rank owns when DataParallel shards (ZeRO).

A sharded engine cuts each flat bucket (the parameters' values and their gradients, laid
out alike) into one contiguous chunk per rank. The cut is the shared-memory
all-reduce's own (:func:`ddpkit.comm.chunk_bounds`): rank i sums chunk i
there, so a reduce-scatter that keeps only chunk i adds exactly the numbers the
all-reduce adds, in the same order, and sharded training is bit for bit the unsharded
one. A chunk starts on a cache line and may split a parameter; :class:`Piece` says
which part of which parameter a shard holds, which is what a checkpoint records so that
another world size can cut the same state differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddpkit.comm import chunk_bounds
from ddpkit.parallel.engine.buckets import Bucket


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param`` (flattened), at ``at`` in a shard."""

    param: int
    start: int
    stop: int
    at: int


@dataclass(frozen=True)
class BucketShard:
    """Rank ``rank``'s chunk of bucket ``bucket``: elements ``[lo, hi)`` of the flat bucket."""

    bucket: int
    numel: int
    bounds: tuple[int, ...]  # rank r owns [bounds[r], bounds[r + 1])
    rank: int
    pieces: tuple[Piece, ...]

    @property
    def lo(self) -> int:
        return self.bounds[self.rank]

    @property
    def hi(self) -> int:
        return self.bounds[self.rank + 1]


def pieces_in(indices: Sequence[int], offsets: Sequence[int], numels: Sequence[int],
              lo: int, hi: int) -> list[Piece]:
    """The parts of a bucket's parameters (at ``offsets``, of ``numels`` elements) that
    fall in its elements ``[lo, hi)``."""
    found = []
    for index, offset, numel in zip(indices, offsets, numels):
        start, stop = max(lo, offset), min(hi, offset + numel)
        if start < stop:
            found.append(Piece(index, start - offset, stop - offset, start - lo))
    return found


def bucket_shards(buckets: Sequence[Bucket], params: Sequence[torch.Tensor], rank: int,
                  world_size: int) -> list[BucketShard]:
    """Every bucket's cut across ``world_size`` ranks, seen from ``rank``."""
    shards = []
    for bucket in buckets:
        itemsize = bucket.buffer.element_size()
        bounds = tuple(chunk_bounds(bucket.numel, itemsize, world_size))
        numels = [params[i].numel() for i in bucket.param_indices]
        pieces = pieces_in(bucket.param_indices, bucket.offsets, numels,
                           bounds[rank], bounds[rank + 1])
        shards.append(BucketShard(bucket.index, bucket.numel, bounds, rank, tuple(pieces)))
    return shards
