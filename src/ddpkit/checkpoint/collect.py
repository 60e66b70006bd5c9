"""The training state in one dict: built on every rank for :meth:`Checkpointer.save`,
applied on every rank after a load."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ddpkit.checkpoint._dist import _rank, _world_size
from ddpkit.checkpoint.common import IN_DCP
from ddpkit.checkpoint.dcp_load import load_dcp
from ddpkit.checkpoint.dcp_state import model_state, optimizer_from_names, optimizer_state
from ddpkit.checkpoint.fingerprint import _config_json, config_changes, config_fingerprint
from ddpkit.checkpoint.model_state import _preview, load_model_state
from ddpkit.checkpoint.rng import gather_rng_states, set_rng_state
from ddpkit.checkpoint.store import DCP_DIR, FORMAT, SHARD_FILES, Checkpointer, CheckpointError
from ddpkit.errors import DdpkitError
from ddpkit.log import get_logger
from ddpkit.parallel.exact.exact_reducer import ExactReducer
from ddpkit.parallel.zero.sharded_state import is_sharded_state
from ddpkit.slice_count import saved_slice_count

log = get_logger(__name__)


def _exact_of(model: Any) -> ExactReducer | None:
    """The exact-mode engine state of ``model`` (a DataParallel(exact=True)), or None."""
    exact = getattr(model, "exact", None)
    return exact if isinstance(exact, ExactReducer) else None


def _restore_exact(state: Mapping[str, Any], exact: ExactReducer, source: str) -> None:
    """Exact mode continues only its own kind of checkpoint, with the same shard count
    (another count cuts every step differently: not the same run)."""
    saved = state.get("exact")
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{source} was written without exact mode; an exact run "
                              "continues only exact checkpoints (resume it without exact "
                              "mode, or start a new run)")
    ours, theirs = exact.slice_count, saved_slice_count(saved)
    if ours is not None and ours != theirs:
        raise CheckpointError(f"{source} was written with {theirs} slices, this run "
                              f"has {ours}; an exact run resumes with the same count "
                              f"(--slices {theirs})")
    exact.load_state_dict(saved)


def _config_diff(saved_json: str, current_json: str) -> str:
    return _preview(config_changes(saved_json, current_json)) or "config differs"


def _sharded(model: Any) -> bool:
    return getattr(model, "shard", "none") != "none"


def _restore_sharded_optimizer(state: Mapping[str, Any], model: Any, optimizer: Any,
                               sharded_save: bool, source: str) -> None:
    """Format 1: each rank takes the pieces of its new shards from every saved rank's
    file (or from the unsharded state, when the checkpoint was written without sharding)."""
    if not sharded_save:  # written without sharding: cut it into this rank's shards
        try:
            model.load_unsharded_optimizer_state(optimizer, state["optimizer"])
        except DdpkitError as err:
            raise CheckpointError(f"{source}: {err}") from None
        return
    if not _sharded(model):
        raise CheckpointError(f"{source} holds a sharded optimizer state; resume it into "
                              "DataParallel(shard='optimizer' or 'gradients')")
    files = state.get(SHARD_FILES)
    if not files:
        raise CheckpointError(f"{source}: its optimizer state is sharded but no per-rank files "
                              "are listed with it; load it through Checkpointer.load")
    parts = (Checkpointer(os.path.dirname(f) or ".", create=False).load(f)["optimizer"]
             for f in files)
    try:
        model.load_optimizer_shards(optimizer, state["optimizer"], parts)
    except DdpkitError as err:
        raise CheckpointError(f"{source}: {err}") from None


def collect_state(
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    sampler: Any = None,
    step: int = 0,
    epoch: int = 0,
    config: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Collective: the training state to pass to :meth:`Checkpointer.save`.

    Call on every rank (it gathers each rank's RNG state to rank 0). ``sampler`` and
    ``scheduler`` are anything with ``state_dict()``. ``extra`` must hold only tensors,
    numbers, strings, lists and dicts (it is loaded with ``weights_only=True``).
    """
    state: dict[str, Any] = {
        "format": FORMAT,
        "step": int(step),
        "epoch": int(epoch),
        "world_size": _world_size(),
        "rng": gather_rng_states(),
    }
    if model is not None:  # a sharded DataParallel gathers every rank's shards first
        state["model"] = model_state(model)
    if optimizer is not None and model is not None:
        # Named as torch's state_dict helpers name it; a ZeRO rank holds its pieces only.
        state["optimizer"] = optimizer_state(model, optimizer)
    elif optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    if config is not None:
        state["config"] = _config_json(config)
        state["fingerprint"] = config_fingerprint(config)
    exact = _exact_of(model)
    if exact is not None:  # slice count, step and seed of the slices' random streams
        state["exact"] = exact.state_dict()
    if extra:
        state["extra"] = dict(extra)
    return state


def restore_state(
    state: Mapping[str, Any],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    sampler: Any = None,
    config: Any = None,
    rng: bool = True,
    source: str = "checkpoint",
) -> dict[str, Any]:
    """Apply a state from :func:`collect_state`; every rank calls it with the same state.

    Raises :class:`CheckpointError` naming the differing keys when the model does not
    match, or the differing fields when ``config`` is given and its fingerprint differs.
    RNG streams are restored per rank when the world size is unchanged; otherwise they
    are left alone (with a warning) since the ranks they belonged to no longer exist.
    In exact mode (``model`` a ``DataParallel(exact=True)``) the state must come from
    an exact run with the same slice count (else one CheckpointError line),
    and another world size continues the run exactly.
    Returns ``{"step", "epoch", "world_size", "rng_restored"}``.
    """
    fingerprint = state.get("fingerprint")
    if config is not None and fingerprint and fingerprint != config_fingerprint(config):
        raise CheckpointError(
            f"{source} was written with a different config "
            f"({_config_diff(state['config'], _config_json(config))}); "
            "resume with the same config or start a fresh checkpoint directory"
        )
    in_dcp = set(state.get(IN_DCP, ()))
    for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                      ("sampler", sampler)):
        if obj is not None and name not in state and name not in in_dcp:
            raise CheckpointError(f"{source} has no {name} state; it was saved without one")
    exact = _exact_of(model)
    if exact is not None:
        _restore_exact(state, exact, source)
    if in_dcp and (model is not None or optimizer is not None):
        if model is None:
            raise CheckpointError(f"{source}: its optimizer state is named by parameter; "
                                  "restore it together with its model (model=...)")
        if DCP_DIR not in state:
            raise CheckpointError(f"{source}: its model and optimizer are in a DCP checkpoint "
                                  "not named with it; load it through Checkpointer.load")
        load_dcp(state[DCP_DIR], model, optimizer if "optimizer" in in_dcp else None,
                 source=source)
        if "optimizer" in in_dcp:
            optimizer = None  # restored with the model
    elif model is not None:
        load_model_state(model, state["model"], source)
    saved_optimizer = state.get("optimizer")
    sharded_save = is_sharded_state(saved_optimizer)
    if optimizer is not None and (sharded_save or _sharded(model)):
        _restore_sharded_optimizer(state, model, optimizer, sharded_save, source)
    elif optimizer is not None:
        try:
            if isinstance(saved_optimizer, Mapping) and saved_optimizer.get("state") and all(
                    isinstance(k, str) for k in saved_optimizer["state"]):  # not yet saved
                saved_optimizer = optimizer_from_names(optimizer, model, saved_optimizer)
            optimizer.load_state_dict(saved_optimizer)
        except (ValueError, KeyError) as err:
            raise CheckpointError(
                f"{source}: optimizer state does not fit this optimizer: {err}"
            ) from None
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if sampler is not None:
        sampler.load_state_dict(state["sampler"])
    saved_world = int(state.get("world_size", 1))
    rng_restored = False
    per_rank = state.get("rng")
    if rng and per_rank:
        if saved_world == _world_size() and len(per_rank) == saved_world:
            set_rng_state(per_rank[_rank()])
            rng_restored = True
        elif exact is not None:
            log.info(f"{source} was written by {saved_world} ranks, this run has "
                     f"{_world_size()}: exact mode draws every random number per slice, "
                     "so the run continues bit for bit")
        else:
            log.warning(
                f"{source} was written by {saved_world} ranks, this run has {_world_size()}: "
                "model, optimizer and data position are restored exactly, per-rank random "
                "streams start fresh, and results differ in the last bits from an "
                f"uninterrupted {saved_world}-rank run (gradients are summed in another order)"
            )
    return {
        "step": int(state.get("step", 0)),
        "epoch": int(state.get("epoch", 0)),
        "world_size": saved_world,
        "rng_restored": rng_restored,
    }
