"""The shard parameters a sharded DataParallel hands the user's optimizer.

The wrapped module's parameters are moved into one flat tensor per gradient bucket,
laid out exactly as the bucket (each parameter becomes a view of its slot). This rank
owns one chunk of each flat tensor (:mod:`ddpkit.parallel.zero.shard_layout`); under
``"optimizer"`` and ``"gradients"`` the chunk is a view of the flat tensor. The
optimizer gets one ``nn.Parameter`` per *piece*: the part of one module parameter that
falls in this rank's chunk, a view of the chunk, named after that parameter. So the
optimizer the user builds on ``model.parameters()`` updates the module's own weights in
place, for the part this rank owns, holds state (AdamW's two moments) for that part
only, and sees parameters as torch does: parameter groups chosen by name work, and a
parameter that got no gradient (``.grad`` None) is skipped, with its own step count.
A piece's gradient is the same part of the gradient bucket's chunk, summed there by the
reduce-scatter.

After a step each rank has updated only its chunks; :meth:`ShardedParameters.gather`
copies every rank's chunks to everyone (an all-gather in place, through the shared
slots on one host), which the engine runs before the next forward and before a state
dict is taken.

Under ``"parameters"`` (ZeRO-3, ``own_shards``) a chunk is its own tensor and the flat
tensors are only *resident* while something needs them: :meth:`release` frees a flat
tensor's memory (its storage is resized to nothing, so the module's parameters and any
view autograd saved of them stay the same tensors) and :meth:`gather_bucket` gives it
memory again, filled from every rank's shard. :mod:`ddpkit.parallel.zero.layer_gathering`
decides when.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ddpkit.parallel.engine.buckets import Bucket
from ddpkit.parallel.zero.shard_layout import BucketShard, Piece


class ShardedParameters:
    """Flat weights per bucket, this rank's chunk of each and its piece parameters, and
    their gathering."""

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str],
                 buckets: Sequence[Bucket], layout: Sequence[BucketShard], transport, *,
                 own_shards: bool = False):
        self.transport = transport
        self.names = list(names)
        self.layout = list(layout)  # this rank's chunk of every bucket
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
        self.chunks = [flat[s.lo:s.hi].clone() if own_shards else flat[s.lo:s.hi]
                       for flat, s in zip(self.flats, self.layout)]
        # (bucket, piece) of every shard parameter, in bucket order
        self.pieces: list[tuple[int, Piece]] = [(k, piece) for k, s in enumerate(self.layout)
                                                 for piece in s.pieces]
        self.shards = [nn.Parameter(_part(self.chunks[k], piece)) for k, piece in self.pieces]
        if not self.shards:
            # This rank owns no element (a model smaller than the ranks' cache-line cut):
            # one empty parameter, so that an optimizer can still be built on the list.
            self.shards = [nn.Parameter(self.chunks[0][:0] if self.chunks
                                        else torch.empty(0))]
        self.resident = [True] * len(self.flats)
        self.stale = False  # a synchronized backward ran since the last gather
        self.mark_current()

    def named(self) -> list[tuple[str, nn.Parameter]]:
        """The shard parameters under the names of the module parameters they are cut
        from (empty when this rank owns nothing)."""
        return [(self.names[piece.param], p) for (_, piece), p in zip(self.pieces, self.shards)]

    def set_grads(self, chunk_grads: Sequence[torch.Tensor], unused: set[int]) -> None:
        """Each piece's gradient is its part of its bucket's (reduced) gradient chunk;
        None for a module parameter in ``unused`` (no rank gave it a gradient), which
        torch's optimizers then skip, as they skip it unsharded."""
        for (k, piece), shard in zip(self.pieces, self.shards):
            shard.grad = None if piece.param in unused else _part(chunk_grads[k], piece)

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
        self.mark_current()

    def mark_current(self) -> None:
        """The module holds every rank's current values now (built, gathered or loaded)."""
        self.stale = False
        self._versions = [flat._version for flat in self.flats]

    def stepped_since_gather(self) -> bool:
        """Whether this rank's chunks changed since the module last held every rank's
        values: the optimizer wrote through the shard parameters (views of the flat
        weights, so they bump the flats' version counters; writes through the module's
        own parameters do not), and the other ranks' chunks in the module are stale."""
        return any(flat._version != seen for flat, seen in zip(self.flats, self._versions))

    def gather_bucket(self, b: int) -> None:
        """``own_shards``: bucket ``b``'s full parameters back in memory, from every
        rank's shard (collective; nothing to do if they are resident)."""
        if self.resident[b]:
            return
        flat, s = self.flats[b], self.layout[b]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        with torch.no_grad():
            flat[s.lo:s.hi].copy_(self.chunks[b])
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
                    self.chunks[b].copy_(flat[s.lo:s.hi])


def _part(chunk: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The elements of ``chunk`` that hold ``piece``."""
    return chunk[piece.at:piece.at + piece.stop - piece.start]
