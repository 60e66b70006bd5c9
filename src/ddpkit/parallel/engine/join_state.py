"""Uneven inputs, the model's side: shared by ddpkit.join and torch's Join.

The state a join keeps per model (:class:`JoinState`), what torch's ``Join`` calls on a
model (:class:`TorchJoinHook`, :class:`ModelJoin`) and DataParallel's own part of it
(:class:`JoinMethods`, a mixin: the shadow iteration, the final state, torch's
``Joinable`` interface). Kept apart from :mod:`ddpkit.parallel.join` so that
DataParallel and the join context (which needs DataParallel) do not import each other.
``model`` below is always a :class:`ddpkit.DataParallel`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.join import Join, JoinHook

from ddpkit.errors import ConfigError


class JoinState:
    """Per-model bookkeeping while a join context is open."""

    def __init__(self, model: Any, divide_by_initial_world_size: bool):
        model._check_joinable()
        self.world_size = model.world_size
        self.rank = model.rank
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.last_active: list[int] = list(range(self.world_size))
        self.device = next(model.module.parameters()).device

    def exchange(self, model: Any, *, active: bool, sync: bool) -> tuple[list[int], bool]:
        """The per-forward all-reduce: who still trains, and do they reduce gradients now."""
        flags = torch.zeros(self.world_size + 1, dtype=torch.int32, device=self.device)
        if active:
            flags[self.rank] = 1
            flags[-1] = int(sync)
        if self.world_size > 1:  # the model's transport: no backend call under shm
            model.transport.sum_(flags)
        values = flags.tolist()
        ranks = [r for r in range(self.world_size) if values[r]]
        if ranks:
            self.last_active = ranks
        return ranks, values[-1] > 0

    def divisor(self, n_active: int) -> int:
        return self.world_size if self.divide_by_initial_world_size else n_active


class TorchJoinHook:
    """What torch's ``Join([model, ...])`` calls on a ddpkit.DataParallel.

    torch's Join runs ``main_hook`` on a rank that left its loop once per iteration the
    others still run, and ``post_hook`` when everyone has left. Both reuse ddpkit.join's
    machinery: the per-forward exchange of who still trains, then the shadow iteration.
    """

    def __init__(self, model: Any, divide_by_initial_world_size: bool):
        if model._join_state is not None:
            raise ConfigError("this model is already inside a join() block; use either "
                              "ddpkit.join or torch's Join around it, not both")
        self.model = model
        self.state = JoinState(model, divide_by_initial_world_size)
        model._torch_join_state = self.state

    def main_hook(self) -> None:
        self.model._join_state = self.state
        active, sync = self.state.exchange(self.model, active=False, sync=False)
        if active:
            self.model._shadow_iteration(active, sync, self.state.divisor(len(active)))

    def post_hook(self, is_last_joiner: bool) -> None:
        if len(self.state.last_active) < self.state.world_size:
            self.model._sync_final_state(max(self.state.last_active))
        self.model._join_state = None
        self.model._torch_join_state = None


class ModelJoin(Join):
    """torch's ``Join`` over DataParallel models (what ``model.join()`` returns): on the
    way out, also when torch's Join raised (``throw_on_early_termination``), the models
    forget the join, so their next forwards need no partner."""

    def __exit__(self, kind, value, traceback):
        try:
            return super().__exit__(kind, value, traceback)
        finally:
            for joinable in self._joinables:
                joinable._join_state = None
                joinable._torch_join_state = None


class JoinMethods:
    """DataParallel's part of a join (a mixin: reads its ``reducer``, ``sparse``,
    ``transport``, ``module``, ``_logging`` and its buffers; its ``_check_joinable``
    refuses a mode that cannot join)."""

    def _shadow_iteration(self, active: list[int], sync: bool, divisor: int) -> None:
        """Issue the collectives one forward+backward on the active ranks will issue."""
        src = max(active)
        if sync:
            self.reducer.maybe_rebuild(src)
        self._forward_buffers(src, sync)
        if sync:
            self.reducer.shadow_backward(divisor)
            if self.sparse is not None:
                self.sparse.shadow_backward(divisor)

    def _sync_final_state(self, src: int) -> None:
        """After join: ranks that stopped early take the last trainer's parameters."""
        tensors = [p.detach() for p in self.module.parameters()] + self._buffers_to_sync
        self.transport.broadcast(tensors, src)

    # torch's Joinable interface: torch.distributed.algorithms.Join([model, ...]) drives the
    # same shadowing as ddpkit.join (see TorchJoinHook).

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self._logging.set("join_uneven_inputs", 1)
        return TorchJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch DDP's method: ``with model.join(): ...`` lets ranks with fewer batches
        leave their loop early (torch's ``Join`` over this model; see ddpkit.join)."""
        return ModelJoin([self], enable, throw_on_early_termination,
                         divide_by_initial_world_size=divide_by_initial_world_size)

    @property
    def join_device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def join_process_group(self) -> Any:
        return self.process_group
