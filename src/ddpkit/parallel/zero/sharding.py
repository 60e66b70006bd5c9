"""``DataParallel(model, shard=...)``: ZeRO stages 1, 2 and 3 on the engine's own buckets.

* ``"none"``: every rank holds all of the optimizer state (plain data parallelism).
* ``"optimizer"`` (ZeRO-1): ``model.parameters()`` yields this rank's shard pieces, so the
  optimizer the user builds keeps state for 1/W of the weights. Buckets are all-reduced
  as usual; the wrapped module's ``.grad`` hold the full averaged gradients after
  backward (for inspection or clipping), and each shard's gradient is its chunk of them.
* ``"gradients"`` (ZeRO-2): as above, but each bucket is reduce-scattered: every rank
  sums only the chunk it owns, with no write-back to its peers; the module's ``.grad``
  are cleared after backward, since only this rank's chunks hold reduced values.
* ``"parameters"`` (ZeRO-3): as ``"gradients"``, and the full parameters are in memory
  only while a module holding them runs forward or backward (gathered per bucket,
  released after; :mod:`ddpkit.parallel.zero.layer_gathering`).

All three sum every element in the order the unsharded all-reduce does (the shard cut is the
all-reduce's own, :mod:`ddpkit.parallel.zero.shard_layout`), so weights are bit for bit those
of ``shard="none"`` with the same ``comm`` (gathering copies values exactly). After
``opt.step()`` only this rank's chunks of the weights are new; the next forward (or
state dict) first gathers every rank's.

The layout is fixed at construction (no re-bucketing after the first backward): the
optimizer holds the shard parameters cut from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist

from ddpkit.comm import all_reduce as comm_all_reduce
from ddpkit.errors import ConfigError, UsageError
from ddpkit.parallel.zero.layer_gathering import LayerGathering
from ddpkit.parallel.zero.shard_layout import bucket_shards
from ddpkit.parallel.zero.sharded_params import ShardedParameters
from ddpkit.vocabulary import SHARD_CHOICES


def check_mode(shard: str) -> str:
    if shard not in SHARD_CHOICES:
        raise ConfigError(f"shard must be one of {', '.join(SHARD_CHOICES)}, got {shard!r}")
    return shard


def agree_on_mode(mode: str, group) -> None:
    """Every rank must shard alike (the collectives differ): one ConfigError everywhere."""
    modes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(modes, mode, group=group)
    if len(set(modes)) > 1:
        listed = ", ".join(f"rank {r}: {m!r}" for r, m in enumerate(modes))
        raise ConfigError(f"DataParallel(shard=...) differs across ranks ({listed}); pass the "
                          "same shard mode on every rank")


class Sharding:
    """What a sharded DataParallel adds around its reducer."""

    def __init__(self, mode: str, reducer, transport, group, module: torch.nn.Module):
        self.mode = mode
        self.group = group
        self.reducer = reducer
        # The shards the optimizer holds are cut from this layout: keep it.
        reducer.rebuilt = True
        # Which chunk of every bucket this rank owns: cut here, once, for the shard
        # parameters and (ZeRO-2 and 3) for the reducer's reduce-scatter alike.
        layout = bucket_shards(reducer.buckets, reducer.params, dist.get_rank(group),
                               dist.get_world_size(group))
        if self.scatters:
            reducer.keep(layout)
        self.params = ShardedParameters(reducer.params, reducer.names, reducer.buckets, layout,
                                        transport, own_shards=mode == "parameters")
        self.layers: LayerGathering | None = None
        if mode == "parameters":
            self.layers = LayerGathering(module, reducer.params, reducer.bucket_of, self.params)
            reducer.after_bucket = self.layers.after_reduction
            self.layers.release_all()
        else:
            module.register_state_dict_pre_hook(self._refuse_stale)
        self._reduced = False  # module .grad hold a finished reduction (not to accumulate)
        reducer.after_backward.append(self._after_backward)

    def _refuse_stale(self, module: torch.nn.Module, *args) -> None:
        # After opt.step() the module holds other ranks' chunks of the step before: its
        # state dict would silently mix two steps. Gathering here would be a collective
        # that a rank-0-only read hangs in, so the caller must gather on every rank.
        if self.params.stepped_since_gather():
            raise UsageError(
                f"DataParallel(shard={self.mode!r}) updates only this rank's chunk of the "
                "weights in opt.step(): call model.gather_parameters() on every rank before "
                "reading model.module's state (model.state_dict() does it)")

    @property
    def scatters(self) -> bool:
        """Whether each rank keeps only its chunk of every reduced gradient bucket."""
        return self.mode in ("gradients", "parameters")

    def _after_backward(self) -> None:
        if self.scatters:  # the reducer kept each bucket's reduced chunk
            chunks = self.reducer.grad_shards
        else:
            chunks = [b.buffer[s.lo:s.hi] for b, s in zip(self.reducer.buckets,
                                                           self.params.layout)]
        self.params.set_grads(chunks, self.reducer.left_unused)
        if self.layers is not None:
            self.layers.release_all()  # the optimizer steps the shards next
        else:
            self.params.stale = True
        self._reduced = True

    def before_forward(self) -> None:
        """Gather updated shards (collective, alike on every rank: a synchronized
        backward ran on all of them) and drop gradients a finished reduction left in
        the module, so the next backward does not add onto them (the user's
        ``zero_grad`` only reaches the shards)."""
        if self.layers is not None:
            if self._reduced or self.layers.held:
                # what gather_parameters() held may predate opt.step()
                self.layers.release_all()
            self.layers.before_forward()
        elif self.params.stale:
            self.params.gather()
        if self._reduced and torch.is_grad_enabled():
            for p in self.reducer.params:
                p.grad = None
            self._reduced = False

    def around_forward(self):
        """Context for the wrapped module's forward (ZeRO-3's first-forward watch)."""
        return self.layers.around_forward() if self.layers is not None else nullcontext()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients the optimizer will use to a total norm of ``max_norm``.

        ``"optimizer"``: the module holds the full averaged gradients (the shards are
        views of them), so this is torch's ``clip_grad_norm_`` on them, and the numbers
        are the unsharded engine's. ``"gradients"`` and ``"parameters"``: the norm over
        every rank's pieces (partial sums combined by one all-reduce), then each piece
        scaled."""
        if not self.scatters:
            return torch.nn.utils.clip_grad_norm_(self.reducer.params, max_norm, norm_type)
        grads = [s.grad for s in self.params.shards if s.grad is not None]
        return clip_sharded(grads, max_norm, norm_type, self.group)


def clip_sharded(grads: Sequence[torch.Tensor], max_norm: float, norm_type: float,
                 group) -> torch.Tensor:
    """torch's clip_grad_norm_ over gradients split across the ranks of ``group``."""
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    dtype = grads[0].dtype if grads else torch.float32
    if math.isinf(norm_type):
        local = max((g.detach().abs().max() for g in grads if g.numel()),
                    default=torch.zeros((), dtype=dtype, device=device))
        total = local.reshape(1).clone()
        comm_all_reduce(total, op="max", group=group)
        total = total[0]
    else:
        parts = [torch.linalg.vector_norm(g.detach(), norm_type) for g in grads if g.numel()]
        local = (torch.stack(parts) ** norm_type).sum() if parts else torch.zeros(
            (), dtype=dtype, device=device)
        total = local.reshape(1).clone()
        comm_all_reduce(total, op="sum", group=group)
        total = total[0] ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total
