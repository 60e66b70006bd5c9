"""ZeRO-2's reducer: every bucket passes through one scratch buffer and leaves only the
chunk this rank owns.

The unsharded reducer keeps one flat buffer per bucket for the whole run, because the
optimizer reads every averaged gradient. Under ``shard="gradients"`` a rank's optimizer
reads only its own chunk of each bucket, so the buckets share one scratch buffer (per
device and dtype, as large as the largest bucket, in the shared segment under shm):
gradients are copied and scaled into it as usual, the bucket is reduce-scattered as soon
as it is complete (the chunk this rank owns summed exactly as the all-reduce sums it),
that chunk is copied into a persistent gradient shard of 1/W of the bucket, and the
scratch is free for the next bucket. Per rank that is ``4/W`` bytes of gradient per fp32
parameter plus one bucket, instead of 4.

A gradient that arrives for a later bucket while the scratch still holds an earlier one
(backward producing gradients out of bucket order) stays where autograd put it and is
copied in when its bucket's turn comes. Buckets therefore launch one at a time, in
order, during backward; the layout is fixed (no re-bucketing), since the optimizer holds
shards cut from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ddpkit.parallel.engine.buckets import (
    Allocator,
    Bucket,
    default_allocator,
    initial_assignment,
)
from ddpkit.parallel.engine.interfaces import ShardingTransport
from ddpkit.parallel.engine.reducer import BucketReducer
from ddpkit.parallel.zero.shard_layout import BucketShard


class ScatterReducer(BucketReducer):
    """The engine's reducer, keeping only this rank's chunk of each reduced bucket.

    Which chunk is the sharding's cut (:func:`ddpkit.parallel.zero.shard_layout.
    bucket_shards`), given by :meth:`keep` once the buckets exist and before the first
    backward; ``grad_shards[b]`` then holds bucket b's reduced chunk after each
    synchronized backward. Its transport is a
    :class:`~ddpkit.parallel.engine.interfaces.ShardingTransport`.
    """

    transport: ShardingTransport

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], group, *,
                 limits_bytes: Sequence[int], allocate: Allocator | None = None,
                 initial_bucketing: str = "reverse", **options):
        params = list(params)
        assignment = initial_assignment(params, list(limits_bytes), initial_bucketing)
        largest: dict[tuple, int] = {}
        for indices in assignment:
            first = params[indices[0]]
            key = (first.dtype, first.device)
            largest[key] = max(largest.get(key, 0), sum(params[i].numel() for i in indices))
        # Private: the slots carry the peers' parts, so no shared region of a whole
        # bucket is mapped into every rank.
        self._scratch = {key: default_allocator(numel, *key) for key, numel in largest.items()}

        def in_scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self._scratch[(dtype, device)][:numel]

        super().__init__(params, names, group, limits_bytes=limits_bytes, allocate=in_scratch,
                         initial_bucketing=initial_bucketing, **options)
        self.rebuilt = True  # the optimizer's shards are cut from this layout
        self._defer_launches = False  # the scratch must be free before the next bucket
        self.chunks: list[tuple[int, int]] = []
        self.grad_shards: list[torch.Tensor] = []
        self._waiting: dict[int, list[int]] = {}  # bucket -> parameters not yet copied in
        # ZeRO-3's release of a bucket's parameters once its gradients are reduced
        self.after_bucket: Callable[[int], None] | None = None

    def keep(self, layout: Sequence[BucketShard]) -> None:
        """Keep chunk ``[lo, hi)`` of every bucket from now on (this rank's, in
        ``layout``), in a persistent gradient shard per bucket."""
        self.chunks = [(s.lo, s.hi) for s in layout]
        self.grad_shards = [torch.zeros(hi - lo, dtype=b.buffer.dtype, device=b.buffer.device)
                            for b, (lo, hi) in zip(self.buckets, self.chunks, strict=True)]

    def arm(self, divisor: int) -> None:
        super().arm(divisor)
        self._waiting = {}

    def _mark_ready(self, i: int, param: torch.Tensor) -> None:
        bucket = self.bucket_of[i]
        if bucket != self.next_to_launch:  # the scratch holds an earlier bucket still
            self._waiting.setdefault(bucket, []).append(i)
            self._count_ready(i)
            return
        super()._mark_ready(i, param)

    def _launch_now(self, bucket: Bucket, buffer: torch.Tensor,
                    views: list[torch.Tensor]) -> None:
        # (BucketReducer._launch runs this outside autograd's thread-local state.)
        for i in self._waiting.pop(bucket.index, []):
            self._move_into_bucket(i, self.params[i])
        if self.world_size > 1:
            work = self.transport.reduce_own_chunk(buffer)
            if work is not None:
                work.wait()
        lo, hi = self.chunks[bucket.index]
        with torch.no_grad():
            self.grad_shards[bucket.index].copy_(buffer[lo:hi])
        for i in bucket.param_indices:
            self.params[i].grad = None  # the scratch is the next bucket's now
        if self.after_bucket is not None:
            self.after_bucket(bucket.index)

    def shadow_backward(self, divisor: int) -> None:
        raise NotImplementedError("join() is refused for sharded DataParallel")
