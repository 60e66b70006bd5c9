"""Loading a DCP checkpoint's model and optimizer into a ddpkit model, at any world size.

Targets are made from the checkpoint's own metadata (names, shapes, dtypes), checked
against the model first (one line names every missing, extra or mis-shaped name), then
``dcp.load`` (collective) fills them:

* the model: every tensor in full (every rank holds the whole model), then loaded the
  way :func:`~ddpkit.checkpoint.load_model_state` loads any state dict;
* an unsharded optimizer: its state in full, by parameter name;
* a ZeRO optimizer: only this rank's pieces, whatever world size or sharding wrote
  them: each moment's target is a sharded tensor over the piece (the boxes that tile
  it, views of one flat buffer), and DCP copies in the overlapping parts of every saved
  chunk; the engine then takes the buffers as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ddpkit.checkpoint._dist import _initialized, local_device
from ddpkit.checkpoint.common import CheckpointError
from ddpkit.checkpoint.dcp_files import (
    SafeLoadPlanner,
    SafeReader,
    dcp_quiet,
    failure_text,
    read_metadata,
)
from ddpkit.checkpoint.dcp_state import (
    is_sharded,
    optimizer_from_names,
    parameter_aliases,
    sharded,
)
from ddpkit.checkpoint.model_state import (
    check_model_state,
    load_model_state,
    strip_module_prefix,
    unwrap,
)
from ddpkit.errors import DdpkitError
from ddpkit.parallel.zero.sharded_state import FORMAT as SHARDED_FORMAT


def _empty(md: Any, device: torch.device) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype, device=device)
    return None  # a value DCP stored as bytes: loaded in its place


def _meta(md: Any) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype, device="meta")
    return None


def _live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's own tensors, by name, for DCP to read into in place (no second copy
    of the model in memory); none under ZeRO-3, whose module tensors come and go."""
    if getattr(model, "shard", "none") == "parameters":
        return {}
    return {k: v for k, v in strip_module_prefix(unwrap(model).state_dict()).items()
            if isinstance(v, torch.Tensor)}


def _optimizer_entries(md: Mapping[str, Any], prefix: str) -> tuple[dict, dict]:
    """({(name, key): metadata key} of the state, {(group, field): metadata key})."""
    state, groups = {}, {}
    for key in md:
        if key.startswith(prefix + "state."):
            name, _, field = key[len(prefix) + 6:].rpartition(".")
            state[(name, field)] = key
        elif key.startswith(prefix + "param_groups."):
            index, _, field = key[len(prefix) + 13:].partition(".")
            if index.isdigit():
                groups[(int(index), field)] = key
    return state, groups


def load_dcp(directory: str | Path, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, *, model_prefix: str = "model.",
             optimizer_prefix: str = "optimizer.", keep_groups: bool = False,
             source: str = "checkpoint") -> None:
    """Collective: give ``model`` and ``optimizer`` the state of the DCP checkpoint in
    ``directory`` (keys ``<model_prefix><name>``, ``<optimizer_prefix>state.<name>.<key>``).
    ``keep_groups``: keep this optimizer's hyper-parameters (lr, ...)."""
    try:
        md = read_metadata(directory).state_dict_metadata
    except Exception as err:
        raise CheckpointError(f"{source}: cannot read its DCP metadata ({type(err).__name__}: "
                              f"{err}); is it a torch.distributed.checkpoint directory?") from None
    device = local_device()
    target: dict[str, Any] = {}
    if model is not None:
        gather = getattr(model, "gather_parameters", None)
        if callable(gather):  # ZeRO-3: the module's tensors exist only gathered
            gather()
        saved = {k[len(model_prefix):]: v for k, v in md.items() if k.startswith(model_prefix)}
        check_model_state(model, {k: _meta(v) for k, v in saved.items()}, source)
        live = _live_tensors(model)
        target.update({model_prefix + k: live.get(k, _empty(v, device)) if isinstance(
            v, TensorStorageMetadata) else None for k, v in saved.items()})
    state_keys, group_keys = _optimizer_entries(md, optimizer_prefix)
    plan = None
    if optimizer is not None:
        plan = _optimizer_targets(model, md, state_keys, group_keys, target, device, source)
    try:
        with dcp_quiet():
            dcp.load(target, storage_reader=SafeReader(directory), planner=SafeLoadPlanner(),
                     no_dist=not _initialized())
    except CheckpointException as err:
        raise CheckpointError(f"{source}: cannot load it: {failure_text(err)[0]}") from None
    if model is not None:
        loaded = {k[len(model_prefix):]: v for k, v in target.items()
                  if k.startswith(model_prefix)}
        if live:  # read in place: only what DCP stored as bytes is left to load
            unwrap(model).load_state_dict({k: v for k, v in loaded.items() if k not in live},
                                          strict=False)
        else:
            load_model_state(model, loaded, source)
    if optimizer is not None:
        _apply_optimizer(model, optimizer, target, plan, keep_groups, source)


def _optimizer_targets(model: Any, md: Mapping[str, Any], state_keys: dict, group_keys: dict,
                       target: dict[str, Any], device: torch.device, source: str) -> dict:
    names = set(parameter_aliases(model))  # a tied weight's state may be under any name
    strangers = sorted({name for name, _ in state_keys if name not in names})
    if strangers:
        raise CheckpointError(f"{source}: its optimizer state names parameters this model does "
                              f"not have: {strangers[:8]}")
    pieces = _pieces(model) if is_sharded(model) else {}
    flat: dict[str, tuple[int, int, torch.Tensor]] = {}
    for (name, field), key in state_keys.items():
        if pieces and name not in pieces:
            continue  # ZeRO: no element of it on this rank
        value = md[key]
        if name in pieces and _along(field, value, pieces[name][2]):
            # Only this rank's elements: a sharded tensor over views of one flat buffer.
            start, stop, shape, every_rank = pieces[name]
            buffer = torch.empty(stop - start, dtype=value.properties.dtype, device=device)
            target[key] = sharded(buffer, start, stop, shape, every_rank)
            flat[key] = (start, stop, buffer)
        else:
            target[key] = _empty(value, device)
    for key in group_keys.values():
        target[key] = None
    return {"state": state_keys, "groups": group_keys, "flat": flat}


def _along(field: str, md: Any, shape: tuple[int, ...]) -> bool:
    """Whether a saved optimizer value runs along its parameter (AdamW's moments), the
    rule of :mod:`ddpkit.parallel.zero.sharded_state`."""
    return (isinstance(md, TensorStorageMetadata) and field != "step"
            and tuple(md.size) == shape)


def _pieces(model: Any) -> dict[str, tuple[int, int, tuple[int, ...], list]]:
    """Collective: this rank's piece of each parameter it holds one of, (start, stop,
    shape, every rank's (rank, start, stop) of that parameter)."""
    shapes = {n.removeprefix("module."): tuple(p.shape)
              for n, p in zip(model.reducer.names, model.reducer.params)}
    mine = {name: (start, stop, shapes[name])
            for name, (start, stop) in model.shard_spans().items()}
    everyone: list[Any] = [mine]
    if _initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {name: (a, b, shape, [(r, *found[name][:2]) for r, found in enumerate(everyone)
                                 if name in found])
            for name, (a, b, shape) in mine.items()}


def _saved_optimizer(target: Mapping[str, Any], plan: dict) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for (name, field), key in plan["state"].items():
        if key in target:
            state.setdefault(name, {})[field] = target[key]
    groups: dict[int, dict[str, Any]] = {}
    for (index, field), key in plan["groups"].items():
        groups.setdefault(index, {})[field] = target[key]
    return {"state": state, "param_groups": [groups[i] for i in sorted(groups)]}


def _apply_optimizer(model: Any, optimizer: torch.optim.Optimizer, target: Mapping[str, Any],
                     plan: dict, keep_groups: bool, source: str) -> None:
    saved = _saved_optimizer(target, plan)
    try:
        if not is_sharded(model):
            optimizer.load_state_dict(optimizer_from_names(optimizer, model, saved, keep_groups))
            return
        model.load_optimizer_shards(optimizer, *_as_shards(optimizer, saved, plan, keep_groups,
                                                           len(model.reducer.bucket_sizes())))
    except (DdpkitError, ValueError, KeyError) as err:
        raise CheckpointError(f"{source}: optimizer state does not fit this optimizer: "
                              f"{err}") from None


def _as_shards(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], plan: dict,
               keep_groups: bool, buckets: int) -> tuple[dict, list[dict]]:
    """(common, [part]) as ``DataParallel.load_optimizer_shards`` takes them: this rank's
    pieces, as DCP read them, and the values kept per parameter (AdamW's step)."""
    pieces: dict[str, list] = {}
    scalars: dict[str, dict[str, Any]] = {}
    along: dict[str, str] = {}
    for name, values in saved["state"].items():
        for field, value in values.items():
            key = plan["state"][(name, field)]
            if key in plan["flat"]:
                start, stop, buffer = plan["flat"][key]
                along[field] = str(buffer.dtype).removeprefix("torch.")
                pieces.setdefault(name, []).append([start, stop, field, buffer])
            else:
                scalars.setdefault(name, {})[field] = value
    groups = saved["param_groups"]
    if keep_groups or not groups:
        groups = optimizer.state_dict()["param_groups"]
    common = {"format": SHARDED_FORMAT, "buckets": buckets,
              "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups]}
    return common, [{"pieces": pieces, "scalars": scalars, "along": along}]


def read_model_state(directory: str | Path, prefix: str = "model.") -> dict[str, Any]:
    """The model's tensors of a checkpoint directory (or any DCP checkpoint), in full,
    in this process alone (no collective): for tools that look at weights without a
    model to load them into."""
    md = read_metadata(directory).state_dict_metadata
    target = {k: _empty(v, torch.device("cpu")) for k, v in md.items() if k.startswith(prefix)}
    with dcp_quiet():
        dcp.load(target, storage_reader=SafeReader(directory), planner=SafeLoadPlanner(),
                 no_dist=True)
    return {k[len(prefix):]: v for k, v in target.items()}
