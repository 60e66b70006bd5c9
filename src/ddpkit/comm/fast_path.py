"""The commonest call, ``all_reduce(t)`` on the default group, remembered instead of re-derived.

A public collective validates its arguments, resolves ``algo="auto"`` and agrees on the
call before the algorithm runs: microseconds of Python that are a large share of
what the shared-memory engine itself takes for a small tensor. For an algorithm that checks each
call in-band (shm on one host) none of that depends on more than the dtype, the device
type and the op: once a call with those has gone through the full path, the next ones
can go straight to the algorithm with the same signature. Nothing is skipped that the
peers rely on: the in-band check still runs inside the algorithm, so a rank whose call
differs (and takes the full path) still meets the others' calls and every rank raises
the same error.

Routes are forgotten when the default process group changes or an algorithm is
registered or removed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit.comm import registry


def _nothing() -> None:
    return None


# [the default group, weakly (remembering a route keeps no group alive: ddpkit.runtime.lifetime),
#  the algorithm table's version, {(dtype, device type, op): route}]
_owner: list = [_nothing, -1, {}]


def lookup(tensor: torch.Tensor, op: str) -> Callable[[torch.Tensor], object] | None:
    """The remembered route for this call on the default group, or None."""
    owner, version, routes = _owner
    world = dist.group.WORLD
    if world is None or owner() is not world or version != registry.version():
        return None
    return routes.get((tensor.dtype, tensor.device.type, op))


def remember(tensor: torch.Tensor, op: str, route: Callable[[torch.Tensor], object]) -> None:
    """Called after a full-path call of exactly this shape succeeded."""
    world = dist.group.WORLD
    if _owner[0]() is not world or _owner[1] != registry.version():
        _owner[:] = [weakref.ref(world), registry.version(), {}]
    _owner[2][(tensor.dtype, tensor.device.type, op)] = route


def forget() -> None:
    _owner[:] = [_nothing, -1, {}]
