"""The flat shard parameters a sharded DataParallel hands the user's optimizer.

The wrapped module's parameters are moved into one flat tensor per gradient bucket,
laid out exactly as the bucket (each parameter becomes a view of its slot). Under
``"optimizer"`` and ``"gradients"`` this rank's shard of that flat tensor is an
``nn.Parameter`` that is a view too, so the optimizer the user builds on
``model.parameters()`` updates the module's own weights in place, for the part this rank
owns, and holds state (AdamW's two moments) for that part only. Its gradient is the same
chunk of the gradient bucket, summed there by the reduce-scatter.

After a step each rank has updated only its chunks; :meth:`ShardedParameters.gather`
copies every rank's chunks to everyone (an all-gather in place, through the shared
slots on one host), which the engine runs before the next forward and before a state
dict is taken.

Under ``"parameters"`` (ZeRO-3, ``own_shards``) a shard is its own tensor and the flat
tensors are only *resident* while something needs them: :meth:`release` frees a flat
tensor's memory (its storage is resized to nothing, so the module's parameters and any
view autograd saved of them stay the same tensors) and :meth:`gather_bucket` gives it
memory again, filled from every rank's shard. :mod:`ddpkit.parallel.layer_gathering`
decides when.
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
                 world_size: int, transport, *, own_shards: bool = False):
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
        self.own_shards = own_shards
        self.shards = [nn.Parameter(flat[s.lo:s.hi].clone() if own_shards else flat[s.lo:s.hi])
                       for flat, s in zip(self.flats, self.layout)]
        self.resident = [True] * len(self.flats)
        self.stale = False  # a synchronized backward ran since the last gather

    def named(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"shard{s.bucket}", p) for s, p in zip(self.layout, self.shards)]

    def point_grads_at(self, buckets: Sequence[Bucket]) -> None:
        """Each shard's gradient is its chunk of the (reduced) gradient bucket."""
        for shard, s, bucket in zip(self.shards, self.layout, buckets):
            shard.grad = bucket.buffer[s.lo:s.hi]

    def gather(self) -> None:
        """Every rank's updated chunks to every rank, in every bucket (collective)."""
        if self.own_shards:
            for b in range(len(self.flats)):
                self.gather_bucket(b)
            return
        with torch.no_grad():
            for flat, s in zip(self.flats, self.layout):
                self.transport.all_gather_chunks(flat, s.bounds)
        self.stale = False

    def gather_bucket(self, b: int) -> None:
        """``own_shards``: bucket ``b``'s full parameters back in memory, from every
        rank's shard (collective; nothing to do if they are resident)."""
        if self.resident[b]:
            return
        flat, s = self.flats[b], self.layout[b]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        with torch.no_grad():
            flat[s.lo:s.hi].copy_(self.shards[b])
            self.transport.all_gather_chunks(flat, s.bounds)
        self.resident[b] = True

    def release(self, b: int) -> None:
        """``own_shards``: free bucket ``b``'s full parameters (this rank's part lives on
        in its shard)."""
        if self.own_shards and self.resident[b]:
            self.flats[b].untyped_storage().resize_(0)
            self.resident[b] = False

    def keep_module_values(self) -> None:
        """``own_shards``: after the module's parameters were written (a state dict
        loaded into them), make every resident bucket's values this rank's shards."""
        with torch.no_grad():
            for b, (flat, s) in enumerate(zip(self.flats, self.layout)):
                if self.resident[b]:
                    self.shards[b].copy_(flat[s.lo:s.hi])
