"""torch.distributed's own collectives, answered by ddpkit's where ddpkit's are proven.

:func:`route` puts a dispatcher behind ``torch.distributed.all_reduce``, ``broadcast``,
``reduce``, ``barrier`` and ``all_gather`` (and the same names in
``torch.distributed.distributed_c10d``, which torch's object collectives such as
``broadcast_object_list`` and ``all_gather_object`` call). These five are the
collectives whose torch tests pass with ddpkit's functions behind torch's names
(tests/test_torch_collective_suite.py; ``all_gather``'s list form is gathered with
``ddpkit.comm.all_gather`` into one tensor, then copied into the list). A call goes to
ddpkit's collective when all of this holds, and to torch's own function, untouched,
otherwise:

* it is synchronous (``async_op=False``) and, for ``barrier``, has no ``timeout``;
* its tensor is a plain dense CPU tensor (or a parameter) of a dtype ddpkit reduces or
  moves, and for a reduction the op is sum, product, min or max; ``all_gather``'s list
  holds one plain CPU tensor per rank of the group, each of the input's dtype and shape;
* its group (the default one when None) is a gloo group;
* it is not a call ddpkit itself makes (ddpkit's modules call torch's collectives on
  purpose: the ``backend`` algorithm, torch-engine comparisons, the object collectives
  that set up its communicators), nor one made while a routed call runs, nor one traced
  by ``torch.compile`` (which rewrites torch's own functions, not these).

Every condition is a property of the call's arguments, which are the same on every rank
of a correct program, so all ranks of a group take the same road. ``restore`` puts
torch's functions back.

A repeated ``all_reduce`` (a metric, a loss: frameworks make one every step) is answered
without judging the same group, op and dtype again: once a call on the default group has
gone through ddpkit's full path, the path ``ddpkit.comm`` remembered for its like (the
shared-memory communicator's small all-reduce, :mod:`ddpkit.comm.shm.direct`) is kept
under the (group, dtype, op object) and called directly while the group is still the
default one (by identity) and the algorithm table unchanged; the tensor's own properties,
the caller and the thread are still checked on every call.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ddpkit.comm import collectives, fast_path, ops, registry
from ddpkit.runtime import lifetime

NAMES = ("all_reduce", "broadcast", "reduce", "barrier", "all_gather")
# The reductions torch's own tests run on ddpkit's functions (sum, product, min, max).
_ROUTED_OPS = {op: name for op, name in ((dist.ReduceOp.SUM, "sum"),
                                        (dist.ReduceOp.PRODUCT, "product"),
                                        (dist.ReduceOp.MIN, "min"),
                                        (dist.ReduceOp.MAX, "max"))}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_MAX_DIRECT = 64
_MODULES = (dist, distributed_c10d)

_originals: dict[str, Callable] = {}  # name -> torch's function while routed


class _Inside(threading.local):
    active = False  # a routed call is running on this thread (a class default: no lookup miss)


_inside = _Inside()
_gloo_groups = lifetime.PerGroup()  # group -> whether ddpkit answers its collectives
_counts = dict.fromkeys(NAMES, 0)  # name -> calls answered by ddpkit in this process
# (id(group), dtype, id(op)) -> (the group, weakly; the op object, which keeps its id
# unique; the dtype; ddpkit's remembered call; the algorithm table's version it was
# found under). torch's default group object is read from distributed_c10d._world (what
# dist.group.WORLD returns, minus a class property per call).
_direct: dict = {}
_NO_ROUTE = (type(None), object(), None, None, -1)  # matches no call (no op is this object)
_last = [_NO_ROUTE]  # the route found last, compared by identity before the map
_WORLD = distributed_c10d._world
# bound once: each saves an attribute lookup on every call of the remembered path
_table_version = registry.version
_compiling = torch.compiler.is_compiling
_getframe = sys._getframe
_plain_caller: list = [None]  # the globals of the last caller found outside ddpkit


def routed() -> bool:
    return bool(_originals)


def counts() -> dict[str, int]:
    """How many calls of each name ddpkit answered in this process."""
    return {name: n for name, n in _counts.items() if n}


def original(name: str) -> Callable:
    """torch's own function behind ``name`` (routed or not)."""
    return _originals.get(name) or getattr(distributed_c10d, name)


def route() -> None:
    """Put the dispatchers behind torch's names (once; idempotent)."""
    if routed():
        return
    for name in NAMES:
        original = getattr(distributed_c10d, name)
        _originals[name] = original
        wrapper = functools.wraps(original)(_DISPATCHERS[name])
        for module in _MODULES:
            setattr(module, name, wrapper)


def restore() -> None:
    """Give torch's names back their own functions."""
    for name, original in _originals.items():
        for module in _MODULES:
            setattr(module, name, original)
    _originals.clear()
    forget()


def _from_ddpkit(depth: int = 2) -> bool:
    """Whether the function calling the dispatcher belongs to ddpkit."""
    return _ddpkit_module(_caller_module(sys._getframe(depth)))


def _caller_module(frame) -> str:
    """The module of ``frame``, or, where that is torch.distributed's own (an object
    collective such as all_gather_object calls all_gather), of the first frame above it
    outside torch.distributed: ddpkit's own object collectives (which it makes while
    setting up its communicators) stay torch's, a program's go to ddpkit."""
    name = frame.f_globals.get("__name__", "")
    while name.startswith("torch.distributed") and frame.f_back is not None:
        frame = frame.f_back
        name = frame.f_globals.get("__name__", "")
    return name


def _ddpkit_module(name: str) -> bool:
    return name.startswith("ddpkit") and (len(name) == 6 or name[6] == ".")


def _group_served(group) -> bool:
    """A gloo group (None: the default group) whose collectives ddpkit answers."""
    if not dist.is_initialized():
        return False
    try:
        served = _gloo_groups.get(group)
    except TypeError:  # not a process group object: torch's function will say so
        return False
    if served is None:
        try:
            served = str(dist.get_backend(group)) == "gloo"
        except (RuntimeError, ValueError):  # not a member, or not a group torch knows
            served = False
        _gloo_groups.set(group, served)
    return served


def _plain_cpu(tensor: Any) -> bool:
    return (type(tensor) in _PLAIN_TENSORS and tensor.device.type == "cpu"
            and tensor.layout == torch.strided)


def _ours(async_op: bool, group) -> bool:
    """The checks every routed call shares (the caller adds its tensor's and op's)."""
    return (not async_op and not _inside.active
            and not torch.compiler.is_compiling() and not _from_ddpkit(3)
            and _group_served(group))


def _default_to_none(group):
    # ddpkit's quickest path is for the default group given as None (ddpkit.comm.fast_path).
    return None if group is not None and group is dist.group.WORLD else group


def _call(name: str, fn: Callable, tensor: torch.Tensor | None, *args: Any) -> None:
    _counts[name] += 1
    _inside.active = True
    try:
        if tensor is not None and tensor.requires_grad:
            # torch's collectives write into a tensor behind autograd's back; ours copy
            # with tensor ops, which autograd would refuse on a leaf that needs grad.
            with torch.no_grad():
                fn(tensor, *args)
        else:
            fn(*((tensor,) if tensor is not None else ()), *args)
    finally:
        _inside.active = False


def _reduction(op, dtype: torch.dtype, collective: str) -> str | None:
    """ddpkit's name of ``op`` when ddpkit reduces ``dtype`` with it, else None."""
    try:
        name = _ROUTED_OPS.get(op)
    except TypeError:  # an unhashable op object (PREMUL_SUM carries a factor)
        return None
    if name is None:
        return None
    try:
        ops.check_op(name, dtype, collective)
    except Exception:
        return None
    return name


def _movable(dtype: torch.dtype) -> bool:
    return dtype in ops.DTYPES or dtype in ops.COMPLEX_DTYPES


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if not async_op and type(tensor) in _PLAIN_TENSORS:
        # the call's group, op and dtype were judged before: only the tensor's own
        # properties and the caller are checked again (as _plain_cpu and _ours do)
        pg = _WORLD.default_pg if group is None else group
        found = _last[0]
        if op is not found[1] or tensor.dtype is not found[2] or found[0]() is not pg:
            found = _direct_for(pg, tensor.dtype, op)
        if (found is not None and found[4] == _table_version() and tensor.is_cpu
                and tensor.layout is _STRIDED and not tensor.requires_grad
                and tensor.is_contiguous() and not _inside.active and not _compiling()
                and (_getframe(1).f_globals is _plain_caller[0] or _plain(_getframe(1)))):
            _counts["all_reduce"] += 1
            found[3](tensor)
            return None
    if _plain_cpu(tensor) and _ours(async_op, group):
        name = _reduction(op, tensor.dtype, "all_reduce")
        if name is not None:
            _call("all_reduce", collectives.all_reduce, tensor, name, _default_to_none(group))
            _remember_direct(tensor, op, group, name)
            return None
    return _originals["all_reduce"](tensor, op, group, async_op)


def _direct_for(pg, dtype: torch.dtype, op) -> tuple | None:
    """The remembered route of (group, dtype, op), made the one checked first; or None."""
    found = _direct.get((id(pg), dtype, id(op)))
    if found is None or found[0]() is not pg or found[1] is not op:
        return None
    _last[0] = found
    return found


def _plain(frame) -> bool:
    """Whether ``frame`` (a dispatcher's caller) runs code outside ddpkit; the answer
    for the last such module is kept by its globals' identity (a dict held, so no other
    module's can take its place), unless the answer came from a frame above it."""
    name = _caller_module(frame)
    if _ddpkit_module(name):
        return False
    if frame.f_globals.get("__name__", "") == name:
        _plain_caller[0] = frame.f_globals
    return True


def _remember_direct(tensor, op, group, name: str) -> None:
    """After a routed all_reduce on the default group: the path ddpkit.comm remembered
    for its like (ddpkit.comm.fast_path), kept under this call's group, dtype and op
    object, so the next such call skips the checks that cannot have changed."""
    pg = _WORLD.default_pg
    if pg is None or (group is not None and group is not pg):
        return
    route = fast_path.lookup(tensor, name)
    if route is None:
        return
    if len(_direct) >= _MAX_DIRECT:  # groups come and go: do not grow forever
        _direct.clear()
    found = (weakref.ref(pg), op, tensor.dtype, route, registry.version())
    _direct[id(pg), tensor.dtype, id(op)] = _last[0] = found


def forget() -> None:
    """Drop every remembered all_reduce route (the next call of each shape judges anew)."""
    _direct.clear()
    _last[0] = _NO_ROUTE


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    if _plain_cpu(tensor) and _movable(tensor.dtype) and _ours(async_op, group):
        return _call("broadcast", collectives.broadcast, tensor, src, _default_to_none(group),
                     False, group_src)
    return _originals["broadcast"](tensor, src, group, async_op, group_src)


def _reduce(tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False,
            group_dst=None):
    if _plain_cpu(tensor) and _ours(async_op, group):
        name = _reduction(op, tensor.dtype, "reduce")
        if name is not None:
            return _call("reduce", collectives.reduce, tensor, dst, name,
                         _default_to_none(group), False, group_dst)
    return _originals["reduce"](tensor, dst, op, group, async_op, group_dst)


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    if (_plain_cpu(tensor) and _movable(tensor.dtype) and _ours(async_op, group)
            and _gather_list(tensor_list, tensor, group)):
        return _call("all_gather", _gather_into_list, tensor, tensor_list,
                     _default_to_none(group))
    return _originals["all_gather"](tensor_list, tensor, group, async_op)


def _gather_list(tensor_list, tensor, group) -> bool:
    """A list of one plain CPU tensor per group rank, each of ``tensor``'s dtype and
    shape: what gloo gathers into (anything else goes to torch, which says what is wrong)."""
    if type(tensor_list) is not list or len(tensor_list) != dist.get_world_size(group):
        return False
    return all(_plain_cpu(out) and out.dtype == tensor.dtype and out.shape == tensor.shape
               for out in tensor_list)


def _gather_into_list(tensor, tensor_list, group) -> None:
    """torch's list form of all_gather on ddpkit.comm's (one output tensor): gathered
    into one block, then each rank's part copied into its tensor of the list."""
    numel = tensor.numel()
    gathered = torch.empty(len(tensor_list) * numel, dtype=tensor.dtype)
    # a conjugate or negative view's bytes are not its values: give ddpkit the values
    collectives.all_gather(gathered, tensor.resolve_conj().resolve_neg(), group)
    grad = any(out.requires_grad for out in tensor_list)
    with torch.no_grad() if grad else contextlib.nullcontext():
        for i, out in enumerate(tensor_list):
            out.copy_(gathered[i * numel:(i + 1) * numel].view(out.shape))


def _barrier(group=None, async_op=False, device_ids=None, timeout=None):
    if timeout is None and _ours(async_op, group):
        return _call("barrier", collectives.barrier, None, _default_to_none(group))
    return _originals["barrier"](group, async_op, device_ids, timeout)


_DISPATCHERS = {"all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce,
                "barrier": _barrier, "all_gather": _all_gather}
