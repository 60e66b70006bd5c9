"""Model and optimizer state in DCP's terms, named as torch's state_dict helpers name it.

``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` names a
model's tensors by their parameter names (no ``module.`` prefix) and an optimizer's
state ``{"state": {name: {"exp_avg": ...}}, "param_groups": [{..., "params": [names]}]}``;
``dcp.save({"model": ..., "optimizer": ...})`` stores them under ``model.<name>`` and
``optimizer.state.<name>.<key>``. ddpkit writes exactly that, so torch's tools and
torch's own programs read ddpkit's checkpoints and the other way round.

A ZeRO rank holds *pieces*: elements ``[start, stop)`` of a flattened parameter. Its
part of a moment (AdamW's ``exp_avg``) is written as a ``ShardedTensor`` over the
parameter's whole shape whose local shards are the boxes that tile the piece (a flat
range of a row-major tensor is at most a few boxes, each a view without a copy): DCP's
metadata then holds every rank's offsets, and a load at any world size, sharded or
not, reads the elements it needs from whichever files hold them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from ddpkit.checkpoint._dist import _initialized, _rank, _world_size
from ddpkit.checkpoint.common import CheckpointError
from ddpkit.checkpoint.model_state import strip_module_prefix, unwrap

Box = tuple[tuple[int, ...], tuple[int, ...], int, int]  # offsets, sizes, flat start, stop


def boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[Box]:
    """The boxes (offsets, sizes) that tile elements ``[start, stop)`` of a row-major
    tensor of ``shape``, each with its flat range: contiguous, so a view of the range."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (stop - start,) if shape else (), start, stop)]
    inner = math.prod(shape[1:])
    found: list[Box] = []

    def rows(first: int, a: int, b: int) -> None:  # [a, b) inside row ``first``
        base = first * inner
        for off, size, s, e in boxes(a - base, b - base, tuple(shape[1:])):
            found.append(((first, *off), (1, *size), s + base, e + base))

    if start % inner:
        end = min(stop, (start // inner + 1) * inner)
        rows(start // inner, start, end)
        start = end
    full = (stop - start) // inner
    if full:
        found.append(((start // inner,) + (0,) * (len(shape) - 1), (full, *shape[1:]),
                      start, start + full * inner))
        start += full * inner
    if start < stop:
        rows(start // inner, start, stop)
    return found


def _props(t: torch.Tensor) -> TensorProperties:
    return TensorProperties(dtype=t.dtype, layout=torch.strided, requires_grad=False,
                            memory_format=torch.contiguous_format, pin_memory=False)


def sharded(flat: torch.Tensor, start: int, stop: int, shape: tuple[int, ...],
            every_rank: list[tuple[int, int, int]]) -> ShardedTensorBase:
    """A ShardedTensor of global ``shape`` whose local shards are views of ``flat`` (this
    rank's elements ``[start, stop)``); ``every_rank``: (rank, start, stop) of all pieces
    of this tensor on every rank, for the global metadata."""
    where = f"{flat.device.type}" if flat.device.type == "cpu" else str(flat.device)
    shards_md = [ShardMetadata(list(off), list(size), f"rank:{r}/{where}")
                 for r, a, b in every_rank for off, size, _, _ in boxes(a, b, shape)]
    local = [Shard(flat[s - start:e - start].view(size),
                   ShardMetadata(list(off), list(size), f"rank:{_rank()}/{where}"))
             for off, size, s, e in boxes(start, stop, shape)]
    meta = ShardedTensorMetadata(shards_md, torch.Size(shape), _props(flat))
    tensor = ShardedTensorBase._init_from_local_shards_and_global_metadata(local, meta)
    # torch's sharded ops (``size()``, which DCP's load planner asks) take the group from
    # here; the base constructor leaves it unset. None: the default group.
    tensor._process_group = None
    return tensor


# ---------------------------------------------------------------------- saving
def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The unwrapped model's state dict (a sharded DataParallel gathers first)."""
    gather = getattr(model, "gather_parameters", None)
    if callable(gather):
        gather()
    return strip_module_prefix(unwrap(model).state_dict())


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's name as torch's state_dict helpers key its optimizer state: the
    first name ``named_parameters()`` reaches it by (a tied weight has several)."""
    return {id(p): n for n, p in unwrap(model).named_parameters()}


def parameter_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every name of every parameter -> the name :func:`parameter_names` gives it, so a
    state saved under another name of a tied weight still finds it."""
    first = parameter_names(model)
    return {n: first[id(p)] for n, p in unwrap(model).named_parameters(remove_duplicate=False)}


def is_sharded(model: Any) -> bool:
    return getattr(model, "shard", "none") != "none"


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state in the helpers' naming (collective for a sharded model)."""
    if is_sharded(model):
        return _sharded_optimizer_state(model, optimizer)
    names = parameter_names(model)
    order = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = [i for i, p in enumerate(order) if id(p) not in names]
    if strangers:
        raise CheckpointError(f"the optimizer holds {len(strangers)} parameters that are not "
                              "the model's; build it on model.parameters()")
    saved = optimizer.state_dict()
    return {"state": {names[id(order[i])]: dict(v) for i, v in saved["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [names[id(order[i])] for i in g["params"]]}
                             for g in saved["param_groups"]]}


def _sharded_optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    # no copies: the checkpoint is written before the optimizer's next step
    common, mine = model.optimizer_shard_state(optimizer, copy=False)
    names = [n.removeprefix("module.") for n in model.reducer.names]
    shapes = {n: tuple(p.shape) for n, p in zip(names, model.reducer.params)}
    order = {n: i for i, n in enumerate(names)}.__getitem__  # registration order
    piece_name = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    groups = [sorted({piece_name[id(p)] for p in g["params"] if id(p) in piece_name},
                     key=order) for g in optimizer.param_groups]
    spans = {(n, key): (start, stop) for n, entries in mine["pieces"].items()
             for start, stop, key, _ in entries}
    everyone: list[Any] = [(groups, spans)]
    if _initialized():
        everyone = [None] * _world_size()
        dist.all_gather_object(everyone, (groups, spans))
    state: dict[str, dict[str, Any]] = {}
    for n, entries in mine["pieces"].items():
        for start, stop, key, tensor in entries:
            ranks = [(r, *found[1][(n, key)]) for r, found in enumerate(everyone)
                     if (n, key) in found[1]]
            state.setdefault(n, {})[key] = sharded(tensor, start, stop, shapes[n], ranks)
    for n, values in mine["scalars"].items():
        state.setdefault(n, {}).update(values)
    members = [sorted({n for found in everyone for n in found[0][g]}, key=order)
               for g in range(len(optimizer.param_groups))]
    return {"state": state,
            "param_groups": [{**g, "params": m} for g, m in zip(common["param_groups"], members)]}


def optimizer_from_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                         saved: Mapping[str, Any], keep_groups: bool = False) -> dict[str, Any]:
    """An optimizer state in the helpers' naming as ``optimizer.load_state_dict`` takes
    it (positions), for an unsharded ``optimizer`` built on ``model``'s parameters.
    ``keep_groups``: this optimizer's hyper-parameters instead of the saved ones."""
    names = parameter_names(model)
    aliases = parameter_aliases(model)
    saved = {**saved, "state": {aliases.get(n, n): v for n, v in saved.get("state", {}).items()}}
    current = optimizer.state_dict()
    order = [p for group in optimizer.param_groups for p in group["params"]]
    position = {names.get(id(p)): i for i, p in enumerate(order)}
    saved_groups = list(saved.get("param_groups") or [])
    if len(saved_groups) != len(current["param_groups"]) and not keep_groups:
        raise CheckpointError(f"the saved optimizer has {len(saved_groups)} parameter groups, "
                              f"this one {len(current['param_groups'])}")
    unknown = sorted(set(saved.get("state", {})) - set(position))
    if unknown:
        raise CheckpointError(f"the saved optimizer state has parameters this optimizer does "
                              f"not hold: {unknown[:8]}")
    groups = []
    for g, group in enumerate(current["param_groups"]):
        theirs = {} if keep_groups else {k: v for k, v in saved_groups[g].items()
                                         if k != "params"}
        groups.append({**group, **theirs})
    return {"state": {position[n]: dict(v) for n, v in saved.get("state", {}).items()},
            "param_groups": groups}
