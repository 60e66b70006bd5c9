"""What ``shard=`` changes in DataParallel's public methods (a mixin of DataParallel).

With sharding the optimizer must hold this rank's shards, not the module's parameters,
and the module holds stale or released weights between steps; so ``parameters()``,
``named_parameters()``, ``state_dict()``/``load_state_dict()`` and ``clip_grad_norm_``
see through to the shards or gather first, and the optimizer's state is saved and
loaded cut by parameter. Without sharding every method here is torch's. Reads the
model's ``_sharding`` (:class:`~ddpkit.parallel.zero.sharding.Sharding` or None),
``reducer`` and ``group``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.parallel.zero import sharded_state


class ShardingMethods:
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters, or with sharding this rank's shard of them: one
        parameter per module parameter with elements on this rank (what the optimizer
        should hold)."""
        if self._sharding is None:
            return super().parameters(recurse)
        return iter(self._sharding.params.shards)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        if self._sharding is None:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        dot = f"{prefix}." if prefix else ""
        return iter([(f"{dot}module.{name}", p) for name, p in self._sharding.params.named()])

    def shard_spans(self) -> dict[str, tuple[int, int]]:
        """This rank's piece of each module parameter it holds one of under sharding:
        ``(start, stop)`` in the parameter's flattened elements, by the parameter's name
        in the wrapped module (no ``module.`` prefix). Empty without sharding (every rank
        holds everything) or when this rank owns no element."""
        if self._sharding is None:
            return {}
        params = self._sharding.params
        return {params.names[piece.param].removeprefix("module."): (piece.start, piece.stop)
                for _, piece in params.pieces}

    def gather_parameters(self) -> None:
        """Give the wrapped module the full updated parameters now (collective; with
        sharding the next forward and ``state_dict()`` do it by themselves; nothing to do
        without sharding). Call it before reading ``model.module``'s weights directly;
        with ``shard="parameters"`` they stay in memory until the next forward (and
        before it the module's parameter tensors have no memory: reading one can crash
        the process)."""
        if self._sharding is None:
            return
        if self._sharding.layers is not None:
            self._sharding.layers.hold()
        elif self._sharding.params.stale:
            self._sharding.params.gather()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """torch's state dict of the full (unsharded) module, ``module.`` prefixed
        (collective with sharding; with ``shard="parameters"`` copies of the gathered
        values, which are freed again unless gather_parameters() holds them)."""
        layers = self._sharding.layers if self._sharding is not None else None
        held = layers is not None and layers.held
        self.gather_parameters()
        state = super().state_dict(*args, **kwargs)
        if layers is not None:
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.clone()
            if not held:
                layers.release_all()
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if self._sharding is not None and self._sharding.layers is not None:
            if assign:
                raise ConfigError("load_state_dict(assign=True) would replace the tensors "
                                  "shard='parameters' gathers into; load without assign")
            self.gather_parameters()  # the shards take the loaded values (LayerGathering)
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self._sharding is not None:
            self._sharding.params.mark_current()  # every rank loaded the same full values
        return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` on the gradients the optimizer will use (this rank's
        shards with sharding: the norm is then over every rank's); returns the total norm."""
        if self._sharding is None:
            return torch.nn.utils.clip_grad_norm_(self.reducer.params, max_norm, norm_type)
        return self._sharding.clip_grad_norm_(max_norm, norm_type)

    def optimizer_shard_state(self, optimizer: torch.optim.Optimizer,
                              copy: bool = True) -> tuple[dict, dict]:
        """With sharding: (what every rank shares, this rank's part) of the optimizer's
        state, cut by parameter so that any world size can load it
        (:mod:`ddpkit.parallel.zero.sharded_state`; ddpkit's checkpoints store the parts as
        one file per rank). ``copy=False`` hands out the optimizer's own tensors instead
        of copies, for a caller that writes them before the next step (checkpoints)."""
        if self._sharding is None:
            raise ConfigError("optimizer_shard_state needs DataParallel(shard='optimizer' or "
                              "'gradients'); without sharding use optimizer.state_dict()")
        return sharded_state.split_state(optimizer, self._sharding.params, self.reducer.names,
                                         copy)

    def load_optimizer_shards(self, optimizer: torch.optim.Optimizer, common: Any,
                              parts: Any) -> None:
        """Give ``optimizer`` this rank's shard of a state saved by
        :meth:`optimizer_shard_state` on every rank of a run of any world size (``parts``:
        each saved rank's part, any order)."""
        if self._sharding is None:
            raise ConfigError("load_optimizer_shards needs DataParallel(shard='optimizer' or "
                              "'gradients'); this model is not sharded")
        sharded_state.load_state(optimizer, self._sharding.params, self.reducer.names, common,
                                 parts)

    def load_unsharded_optimizer_state(self, optimizer: torch.optim.Optimizer,
                                       state_dict: Any) -> None:
        """Give ``optimizer`` this rank's shard of an unsharded optimizer's
        ``state_dict()`` (one built on the module's parameters, its groups by the same
        rule as ``optimizer``'s): a run continues sharded from a checkpoint written
        without sharding. Collective."""
        if self._sharding is None:
            raise ConfigError("load_unsharded_optimizer_state needs DataParallel(shard=...); "
                              "without sharding use optimizer.load_state_dict()")
        groups = sharded_state.unsharded_groups(optimizer, self._sharding.params, self.group)
        common, part = sharded_state.from_unsharded(
            state_dict, self.reducer.params, self.reducer.names,
            len(self.reducer.bucket_sizes()), groups)
        self.load_optimizer_shards(optimizer, common, [part])

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of tensors the optimizer keeps as state on this rank."""
        return sharded_state.state_bytes(optimizer)
