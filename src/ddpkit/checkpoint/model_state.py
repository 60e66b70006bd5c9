"""The user's model inside a checkpoint: unwrapped, without ``module.`` prefixes, and
checked key by key before it is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddpkit.checkpoint.store import CheckpointError


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside torch DDP, ddpkit.DataParallel or similar wrappers."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def strip_module_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the ``module.`` prefix a wrapped model's state_dict carries (the DDP tutorial
    saves ``ddp_model.state_dict()``), so files from wrapped and plain models are the same."""
    keys = list(state)
    prefix = "module."
    while keys and all(k.startswith(prefix) for k in keys):
        state = {k[len(prefix):]: v for k, v in state.items()}
        keys = list(state)
    return dict(state)


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_model_state(
    model: torch.nn.Module, state: Mapping[str, Any], source: str = "checkpoint"
) -> None:
    """Raise one CheckpointError listing missing, unexpected and mis-shaped keys."""
    expected = unwrap(model).state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and torch.is_tensor(v) and torch.is_tensor(state[k])
        and state[k].shape != v.shape
    ]
    parts = []
    if missing:
        parts.append(f"missing keys [{_preview(missing)}]")
    if unexpected:
        parts.append(f"unexpected keys [{_preview(unexpected)}]")
    if shapes:
        parts.append(f"shape mismatch [{_preview(shapes)}]")
    if parts:
        raise CheckpointError(
            f"{source} does not match this model ({type(unwrap(model)).__name__}): "
            + "; ".join(parts)
            + ". Was it written by another model or config?"
        )


def load_model_state(
    model: torch.nn.Module, state: Mapping[str, Any], source: str = "checkpoint"
) -> None:
    """Load a (possibly ``module.``-prefixed) state dict into the unwrapped model, or
    raise one error listing every key that differs."""
    state = strip_module_prefix(state)
    gather = getattr(model, "gather_parameters", None)
    if callable(gather):  # a sharded DataParallel: the module's full weights first
        gather()
    check_model_state(model, state, source)
    unwrap(model).load_state_dict(state)
