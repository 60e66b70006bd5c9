"""A sharded optimizer's state, split by parameter so any world size can load it.

Each rank's optimizer holds state for its shard parameters only: one per piece, the
part of a module parameter that falls in this rank's chunk of its bucket. Saved as is,
that state could only be loaded by the same number of ranks. So every state tensor that
runs along a piece (AdamW's moments) is recorded as ``[start, stop, key, tensor]`` under
the module parameter's name: the elements ``[start, stop)`` of that (flattened)
parameter. Values that do not (AdamW's ``step``) are the same in every piece of a
parameter and are kept once under its name. A rank loading at another world size takes,
from every saved rank's part, the pieces that overlap its new ones.

Format 1 (written before the optimizer got one parameter per piece) kept those values
per bucket; it still loads, each bucket's values going to all of its pieces.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import DdpkitError

FORMAT = "ddpkit-sharded-optimizer/2"
FORMAT_PER_BUCKET = "ddpkit-sharded-optimizer/1"


def is_sharded_state(state: Any) -> bool:
    """Whether ``state`` is the shared part of a sharded optimizer state (any format)."""
    return isinstance(state, Mapping) and state.get("format") in (FORMAT, FORMAT_PER_BUCKET)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors ``optimizer`` keeps as state on this rank."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def _shard_index(optimizer: torch.optim.Optimizer, shards: list[torch.nn.Parameter]) -> list[int]:
    """For each parameter of the optimizer (state_dict order), which shard parameter it is."""
    position = {id(p): k for k, p in enumerate(shards)}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in position]
    if missing or len(order) != len(shards):
        raise DdpkitError("the optimizer must hold exactly the sharded model's parameters "
                          "(build it on model.parameters() of the sharded DataParallel)")
    return [position[id(p)] for p in order]


def split_state(optimizer: torch.optim.Optimizer, params, names: list[str], copy: bool = True
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what every rank shares, this rank's part) of ``optimizer``'s state.

    ``params`` is the engine's :class:`~ddpkit.parallel.zero.sharded_params.ShardedParameters`;
    ``names`` the reducer's parameter names. ``copy=False`` gives the optimizer's own
    tensors (they change at its next step): for a caller that writes them out at once."""
    which = _shard_index(optimizer, params.shards)
    saved = optimizer.state_dict()
    pieces: dict[str, list] = {}
    scalars: dict[str, dict[str, Any]] = {}
    along: dict[str, str] = {}  # keys that run along the pieces -> dtype name
    for index, state in saved["state"].items():
        if which[index] >= len(params.pieces):
            continue  # the empty stand-in of a rank that owns nothing
        _, piece = params.pieces[which[index]]
        name = names[piece.param]
        length = piece.stop - piece.start
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == length \
                    and key != "step":
                along[key] = str(value.dtype).removeprefix("torch.")
                pieces.setdefault(name, []).append([piece.start, piece.stop, key,
                                                     value.clone() if copy else value])
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    common = {"format": FORMAT, "param_groups": groups, "buckets": len(params.layout)}
    return common, {"pieces": pieces, "scalars": scalars, "along": along}


def unsharded_groups(optimizer: torch.optim.Optimizer, params, group) -> list[list[int]]:
    """For each of ``optimizer``'s parameter groups, the module parameters (reducer
    indices) it holds pieces of on any rank of ``group``, in registration order: the
    order an unsharded optimizer lists them when built by the same rule (all of
    ``model.parameters()``, or filters over ``named_parameters()``). Collective."""
    shard_of = {id(p): n for n, p in enumerate(params.shards)}
    mine = {params.pieces[shard_of[id(p)]][1].param: g
            for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]
            if shard_of.get(id(p), len(params.pieces)) < len(params.pieces)}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    member: dict[int, int] = {}
    for found in everyone:
        member.update(found)
    return [[i for i in sorted(member) if member[i] == g]
            for g in range(len(optimizer.param_groups))]


def from_unsharded(saved: Mapping[str, Any], params: list[torch.nn.Parameter], names: list[str],
                   buckets: int, groups: list[list[int]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An unsharded optimizer's ``state_dict()`` as (common, one part): what
    :func:`load_state` takes, so a run can continue sharded from an unsharded checkpoint.
    ``groups``: :func:`unsharded_groups` (torch's state dict numbers parameters by
    position in their groups; this says which module parameter each position is)."""
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups) or any(
            len(g["params"]) != len(members) for g, members in zip(saved_groups, groups)):
        raise DdpkitError(
            "the saved optimizer's parameter groups hold "
            f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer's "
            f"{[len(members) for members in groups]}; build the groups by the same rule")
    pieces: dict[str, list] = {}
    scalars: dict[str, dict[str, Any]] = {}
    along: dict[str, str] = {}
    for saved_group, members in zip(saved_groups, groups):
        for index, i in zip(saved_group["params"], members):
            param, name = params[i], names[i]
            for key, value in saved["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and key != "step" \
                        and value.shape == param.shape:
                    along[key] = str(value.dtype).removeprefix("torch.")
                    pieces.setdefault(name, []).append([0, param.numel(), key,
                                                        value.reshape(-1)])
                else:
                    scalars.setdefault(name, {})[key] = value
    groups_saved = [{k: v for k, v in g.items() if k != "params"} for g in saved_groups]
    return ({"format": FORMAT, "param_groups": groups_saved, "buckets": buckets},
            {"pieces": pieces, "scalars": scalars, "along": along})


def load_state(optimizer: torch.optim.Optimizer, params, names: list[str],
               common: Mapping[str, Any], parts: Iterable[Mapping[str, Any]]) -> None:
    """Rebuild this rank's piece states from every saved rank's part (any world size)."""
    if not is_sharded_state(common):
        raise DdpkitError(f"not a sharded optimizer state (format {common.get('format')!r})")
    if int(common["buckets"]) != len(params.layout):
        raise DdpkitError(f"the sharded optimizer state has {common['buckets']} buckets, this "
                          f"model {len(params.layout)}; resume with the same model and "
                          "bucket_cap_mb")
    per_bucket = common["format"] == FORMAT_PER_BUCKET
    which = _shard_index(optimizer, params.shards)
    by_name = {name: i for i, name in enumerate(names)}
    piece_of = {piece.param: n for n, (_, piece) in enumerate(params.pieces)}
    state: list[dict[str, Any]] = [{} for _ in params.shards]
    filled: dict[tuple[int, str], int] = {}
    along: dict[str, str] = {}
    for part in parts:
        along.update(part.get("along", {}))
        for owner, values in part["scalars"].items():
            if per_bucket:  # format 1: a bucket's values, for each of its pieces
                targets = [n for n, (k, _) in enumerate(params.pieces) if k == int(owner)]
            else:
                n = piece_of.get(by_name.get(owner, -1))
                targets = [] if n is None else [n]
            for n in targets:
                for key, value in values.items():
                    state[n].setdefault(key, value)
        for name, entries in part["pieces"].items():
            if name not in by_name:
                raise DdpkitError(f"the sharded optimizer state has parameter {name!r}, which "
                                  "this model does not")
            n = piece_of.get(by_name[name])
            if n is None:
                continue  # no element of it on this rank
            piece = params.pieces[n][1]
            for start, stop, key, tensor in entries:
                a, b = max(start, piece.start), min(stop, piece.stop)
                if a >= b:
                    continue
                dst = state[n].get(key)
                if dst is None:
                    dst = state[n][key] = torch.zeros(piece.stop - piece.start,
                                                      dtype=tensor.dtype,
                                                      device=params.shards[n].device)
                dst[a - piece.start:b - piece.start].copy_(tensor[a - start:b - start])
                filled[(n, key)] = filled.get((n, key), 0) + b - a
    for n, (_, piece) in enumerate(params.pieces):
        if not state[n]:
            continue  # never stepped (no gradient yet): no state, as in torch
        for key, dtype in along.items():
            length = piece.stop - piece.start
            if key not in state[n]:
                state[n][key] = torch.zeros(length, dtype=getattr(torch, dtype),
                                            device=params.shards[n].device)
            if filled.get((n, key), 0) != length:
                raise DdpkitError(f"the sharded optimizer state covers {filled.get((n, key), 0)}"
                                  f" of {length} elements of {key!r} of {names[piece.param]!r}: "
                                  "a rank's part is missing")
    groups = optimizer.state_dict()["param_groups"]
    saved_groups = common["param_groups"]
    if len(saved_groups) != len(groups):
        raise DdpkitError(f"the saved optimizer has {len(saved_groups)} parameter groups, this "
                          f"one {len(groups)}")
    merged = [{**saved, "params": g["params"]} for saved, g in zip(saved_groups, groups)]
    flat_ids = [i for g in groups for i in g["params"]]
    optimizer.load_state_dict({
        "state": {flat_ids[pos]: state[n] for pos, n in enumerate(which) if state[n]},
        "param_groups": merged,
    })
