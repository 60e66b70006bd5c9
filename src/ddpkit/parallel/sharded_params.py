"""The flat shard parameters a sharded DataParallel hands the user's optimizer.

The wrapped module's parameters are moved into one flat tensor per gradient bucket,
laid out exactly as the bucket (each parameter becomes a view of its slot). This rank's
shard of that flat tensor is an ``nn.Parameter`` that is a view too, so the optimizer
the user builds on ``model.parameters()`` updates the module's own weights in place, for
the part this rank owns, and holds state (AdamW's two moments) for that part only. Its
gradient is the same chunk of the gradient bucket, summed there by the reduce-scatter.

After a step each rank has updated only its chunks; :meth:`ShardedParameters.gather`
copies every rank's chunks to everyone (an all-gather in place, through the shared
slots on one host), which the engine runs before the next forward and before a state
dict is taken.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ddpkit.parallel.buckets import Bucket
from ddpkit.parallel.shard_layout import BucketShard, bucket_shards


class ShardedParameters:
    """Flat weights per bucket, this rank's shard parameters, and their gathering."""

    def __init__(self, params: Sequence[nn.Parameter], buckets: Sequence[Bucket], rank: int,
                 world_size: int, transport):
        self.transport = transport
        self.layout: list[BucketShard] = bucket_shards(buckets, params, rank, world_size)
        self.flats: list[torch.Tensor] = []
        with torch.no_grad():
            for bucket in buckets:
                first = params[bucket.param_indices[0]]
                flat = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
                for i, offset in zip(bucket.param_indices, bucket.offsets):
                    p = params[i]
                    slot = flat[offset:offset + p.numel()]
                    slot.copy_(p.detach().reshape(-1))
                    # The module keeps its Parameter objects (hooks, the reducer and
                    # user references stay valid); only their memory moves.
                    p.data = slot.view_as(p)
                self.flats.append(flat)
        self.shards = [nn.Parameter(flat[s.lo:s.hi]) for flat, s in zip(self.flats, self.layout)]
        self.stale = False  # a synchronized backward ran since the last gather

    def named(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"shard{s.bucket}", p) for s, p in zip(self.layout, self.shards)]

    def point_grads_at(self, buckets: Sequence[Bucket]) -> None:
        """Each shard's gradient is its chunk of the (reduced) gradient bucket."""
        for shard, s, bucket in zip(self.shards, self.layout, buckets):
            shard.grad = bucket.buffer[s.lo:s.hi]

    def gather(self) -> None:
        """Every rank's updated chunks to every rank (collective)."""
        with torch.no_grad():
            for flat, s in zip(self.flats, self.layout):
                self.transport.all_gather_chunks(flat, s.bounds)
        self.stale = False
