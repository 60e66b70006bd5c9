"""A sharded optimizer's state, split by parameter so any world size can load it.

Each rank's optimizer holds state for its shards only (one flat shard per bucket).
Saved as is, that state could only be loaded by the same number of ranks. So every
state tensor that runs along a shard (AdamW's moments) is cut at the parameters it
spans and recorded as ``[start, stop, key, tensor]`` under the parameter's name: the
elements ``[start, stop)`` of that (flattened) parameter. Per-shard values that do not
(AdamW's ``step``) are kept per bucket, which is the same at every world size. A rank
loading at another world size takes, from every saved rank's part, the pieces that
overlap its new shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ddpkit.errors import DdpkitError

FORMAT = "ddpkit-sharded-optimizer/1"


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors ``optimizer`` keeps as state on this rank."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def _shard_index(optimizer: torch.optim.Optimizer, shards: list[torch.nn.Parameter]) -> list[int]:
    """For each parameter of the optimizer (state_dict order), which shard it is."""
    position = {id(p): k for k, p in enumerate(shards)}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in position]
    if missing or len(order) != len(shards):
        raise DdpkitError("the optimizer must hold exactly the sharded model's parameters "
                          "(build it on model.parameters() of the sharded DataParallel)")
    return [position[id(p)] for p in order]


def split_state(optimizer: torch.optim.Optimizer, params, names: list[str]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what every rank shares, this rank's part) of ``optimizer``'s state.

    ``params`` is the engine's :class:`~ddpkit.parallel.sharded_params.ShardedParameters`;
    ``names`` the reducer's parameter names."""
    which = _shard_index(optimizer, params.shards)
    saved = optimizer.state_dict()
    pieces: dict[str, list] = {}
    scalars: dict[int, dict[str, Any]] = {}
    along: dict[str, str] = {}  # keys that run along the shard -> dtype name
    for index, state in saved["state"].items():
        k = which[index]
        shard = params.layout[k]
        length = shard.hi - shard.lo
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == length \
                    and key != "step":
                along[key] = str(value.dtype).removeprefix("torch.")
                for piece in shard.pieces:
                    part = value[piece.at:piece.at + piece.stop - piece.start].clone()
                    pieces.setdefault(names[piece.param], []).append(
                        [piece.start, piece.stop, key, part])
            else:
                scalars.setdefault(shard.bucket, {})[key] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    common = {"format": FORMAT, "param_groups": groups, "buckets": len(params.shards)}
    return common, {"pieces": pieces, "scalars": scalars, "along": along}


def from_unsharded(saved: Mapping[str, Any], params: list[torch.nn.Parameter], names: list[str],
                   bucket_of: list[int], buckets: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """An unsharded optimizer's ``state_dict()`` (built on the module's trainable
    parameters, in their order) as (common, one part): what :func:`load_state` takes, so a
    run can continue sharded from an unsharded checkpoint."""
    order = [i for group in saved["param_groups"] for i in group["params"]]
    if len(order) != len(params):
        raise DdpkitError(f"the saved optimizer holds {len(order)} parameters, this model "
                          f"{len(params)} trainable ones; it cannot be sharded onto them")
    pieces: dict[str, list] = {}
    scalars: dict[int, dict[str, Any]] = {}
    along: dict[str, str] = {}
    for position, index in enumerate(order):
        param = params[position]
        for key, value in saved["state"].get(index, {}).items():
            if isinstance(value, torch.Tensor) and key != "step" and value.shape == param.shape:
                along[key] = str(value.dtype).removeprefix("torch.")
                pieces.setdefault(names[position], []).append(
                    [0, param.numel(), key, value.reshape(-1)])
            else:
                scalars.setdefault(bucket_of[position], {})[key] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    return ({"format": FORMAT, "param_groups": groups, "buckets": buckets},
            {"pieces": pieces, "scalars": scalars, "along": along})


def load_state(optimizer: torch.optim.Optimizer, params, names: list[str],
               common: Mapping[str, Any], parts: Iterable[Mapping[str, Any]]) -> None:
    """Rebuild this rank's shard state from every saved rank's part (any world size)."""
    if common.get("format") != FORMAT:
        raise DdpkitError(f"not a sharded optimizer state (format {common.get('format')!r})")
    if int(common["buckets"]) != len(params.shards):
        raise DdpkitError(f"the sharded optimizer state has {common['buckets']} buckets, this "
                          f"model {len(params.shards)}; resume with the same model and "
                          "bucket_cap_mb")
    which = _shard_index(optimizer, params.shards)
    by_name = {name: i for i, name in enumerate(names)}
    targets: dict[int, list] = {}  # parameter -> [(shard, piece)] of the new layout
    for k, shard in enumerate(params.layout):
        for piece in shard.pieces:
            targets.setdefault(piece.param, []).append((k, piece))
    state: list[dict[str, Any]] = [{} for _ in params.shards]
    filled: dict[tuple[int, str], int] = {}
    along: dict[str, str] = {}
    for part in parts:
        along.update(part.get("along", {}))
        for bucket, values in part["scalars"].items():
            for key, value in values.items():
                state[int(bucket)].setdefault(key, value)
        for name, entries in part["pieces"].items():
            if name not in by_name:
                raise DdpkitError(f"the sharded optimizer state has parameter {name!r}, which "
                                  "this model does not")
            for start, stop, key, tensor in entries:
                for k, piece in targets.get(by_name[name], []):
                    a, b = max(start, piece.start), min(stop, piece.stop)
                    if a >= b:
                        continue
                    shard = params.layout[k]
                    dst = state[k].get(key)
                    if dst is None:
                        dst = state[k][key] = torch.zeros(shard.hi - shard.lo, dtype=tensor.dtype,
                                                          device=params.shards[k].device)
                    at = piece.at + a - piece.start
                    dst[at:at + b - a].copy_(tensor[a - start:b - start])
                    filled[(k, key)] = filled.get((k, key), 0) + b - a
    for k, shard in enumerate(params.layout):
        for key, dtype in along.items():
            if key not in state[k]:
                state[k][key] = torch.zeros(shard.hi - shard.lo, dtype=getattr(torch, dtype),
                                            device=params.shards[k].device)
            if filled.get((k, key), 0) != shard.hi - shard.lo:
                raise DdpkitError(f"the sharded optimizer state covers {filled.get((k, key), 0)}"
                                  f" of {shard.hi - shard.lo} elements of {key!r} in bucket {k}: "
                                  "a rank's part is missing")
    groups = optimizer.state_dict()["param_groups"]
    saved_groups = common["param_groups"]
    if len(saved_groups) != len(groups):
        raise DdpkitError(f"the saved optimizer has {len(saved_groups)} parameter groups, this "
                          f"one {len(groups)}")
    merged = [{**saved, "params": g["params"]} for saved, g in zip(saved_groups, groups)]
    flat_ids = [i for g in groups for i in g["params"]]
    optimizer.load_state_dict({
        "state": {flat_ids[pos]: state[k] for pos, k in enumerate(which) if state[k]},
        "param_groups": merged,
    })
