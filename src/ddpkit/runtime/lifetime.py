"""Process-group lifetimes: nothing of ddpkit outlives the group it serves, and no group
ddpkit touched outlives the program.

Why this matters. A gloo process group runs worker threads. A worker that drops the last
reference to a finished Work must take the GIL when the Work still holds Python objects:
a tensor whose Python object the program already dropped (torch then hands ownership of
that object to the C++ tensor), or thread-local Python state captured when the Work was
created (autograd's stashed ``contextvars`` context, for a collective launched inside
backward). Taking the GIL after the interpreter began finalizing ends the thread with
``pthread_exit``, whose unwinding through C++ ``noexcept`` frames calls
``std::terminate``: "terminate called without an active exception", SIGABRT, after the
program's last line. Workers are joined when the group's C++ object is destroyed, and
torch releases the GIL in that destructor, so a worker with such a drop pending finishes
it there. So the cure is to destroy groups before finalization, and never to keep one
alive by accident:

* ddpkit holds no strong reference to a process group in module state: caches are
  :class:`PerGroup` maps that hold their groups weakly, and what ddpkit builds on a group
  (a shared-memory communicator, a background lane and its companion group) is closed by
  :func:`on_close` callbacks when the group dies, i.e. inside ``destroy_process_group``
  when nothing else holds it;
* at interpreter exit (``atexit`` runs before finalization) every such callback runs, and
  a default group that ddpkit initialized or used is destroyed after the ranks meet
  (:func:`destroy_default_group_at_exit`), so its threads are joined while they can still
  take the GIL;
* :func:`no_python_tls` launches a collective with autograd's stashed Python context taken
  out of thread-local state, so a Work created inside backward captures no Python object.

The version of torch these mechanisms were checked against is
:data:`ddpkit.runtime.torch_target.TORCH_CHECKED`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.log import get_logger

log = get_logger(__name__)

EXIT_BARRIER_S = 30.0  # how long ranks wait for each other at exit before tearing down anyway
_TLS_KEY = "context"  # autograd/graph.py stashes contextvars.copy_context() under this key

_lock = threading.RLock()


def _resolve(group) -> Any:
    """The process-group object ``group`` means (None: the current default group)."""
    if group is None:
        world = dist.group.WORLD if dist.is_initialized() else None
        if world is None:
            raise RuntimeError("no default process group")
        return world
    return group


class _Tracked:
    """Closers of one live group, run once when it dies or at exit."""

    __slots__ = ("closers", "ref")

    def __init__(self, group, key: int):
        self.closers: list[Callable[[], None]] = []
        self.ref = weakref.ref(group, lambda _ref, key=key: _run_closers(key))


_tracked: dict[int, _Tracked] = {}  # id(group) -> closers of that live group


def _entry(group) -> tuple[int, _Tracked]:
    key = id(group)
    with _lock:
        entry = _tracked.get(key)
        if entry is None or entry.ref() is not group:  # an id reused by a new group
            entry = _tracked[key] = _Tracked(group, key)
        return key, entry


def on_close(group, closer: Callable[[], None]) -> None:
    """Run ``closer()`` once, when ``group`` (None: the default group) is destroyed and no
    one holds it any more, or at interpreter exit, whichever comes first. Closers of one
    group run newest first; one that raises is logged and the rest still run."""
    _entry(_resolve(group))[1].closers.append(closer)


def _run_closers(key: int) -> None:
    with _lock:
        entry = _tracked.pop(key, None)
    if entry is None:
        return
    for closer in reversed(entry.closers):
        try:
            closer()
        except Exception as exc:  # teardown goes on: one broken closer must not leak the rest
            log.debug(f"closing a process group's state: {exc!r}")


class PerGroup:
    """A mapping from process group to value that keeps no group alive.

    ``None`` stands for the current default group, as in torch's APIs. An entry goes
    away when its group dies (after ``on_drop(value)``, if given), so a group destroyed
    and a new one created with the same id never see each other's values.
    """

    def __init__(self, on_drop: Callable[[Any], None] | None = None):
        self._values: dict[int, tuple[weakref.ref, Any]] = {}
        self._on_drop = on_drop

    def get(self, group, default=None):
        pg = _resolve(group)
        found = self._values.get(id(pg))
        if found is None or found[0]() is not pg:
            return default
        return found[1]

    def __contains__(self, group) -> bool:
        marker = object()
        return self.get(group, marker) is not marker

    def set(self, group, value) -> None:
        pg = _resolve(group)
        key = id(pg)
        old = self._values.get(key)
        if old is not None and old[0]() is pg:
            self._values[key] = (old[0], value)
            return
        self._values[key] = (weakref.ref(pg), value)
        on_close(pg, lambda key=key, ref=self._values[key][0]: self._drop(key, ref))

    def _drop(self, key: int, ref: weakref.ref) -> None:
        found = self._values.get(key)
        if found is None or found[0] is not ref:
            return
        del self._values[key]
        if self._on_drop is not None and found[1] is not None:
            self._on_drop(found[1])

    def pop(self, group, default=None):
        """Remove ``group``'s entry and return it (``on_drop`` does not run: the caller owns it)."""
        pg = _resolve(group)
        found = self._values.get(id(pg))
        if found is None or found[0]() is not pg:
            return default
        del self._values[id(pg)]
        return found[1]

    def values(self) -> list:
        return [v for ref, v in self._values.values() if ref() is not None]

    def clear(self) -> None:
        """Forget every entry (``on_drop`` runs for each)."""
        for key, (ref, _) in list(self._values.items()):
            self._drop(key, ref)


# ----------------------------------------------------------------------------- at exit

_destroy_default = False


def destroy_default_group_at_exit() -> None:
    """Ask that the default process group be destroyed at interpreter exit if the program
    has not destroyed it by then (after the ranks meet, when the program ends cleanly).

    ddpkit's entry points call this: ``ddpkit.init``, ``DataParallel``, ``ddpkit.Run``
    and every ``ddpkit.comm`` collective, so a program that uses ddpkit ends with its
    gloo threads joined before the interpreter finalizes.
    """
    global _destroy_default
    _destroy_default = True


def close_all() -> None:
    """Run every pending closer (what ddpkit built on every live group), newest group first."""
    with _lock:
        keys = list(_tracked)
    for key in reversed(keys):
        _run_closers(key)


def _ended_by_exception() -> bool:
    # Set by the interpreter when an uncaught exception reached the top level.
    return any(getattr(sys, name, None) is not None for name in ("last_value", "last_exc"))


_exits = [0]  # how many times this process left a default group (a key per leaving)


def leave_together(timeout_s: float = EXIT_BARRIER_S, *, failed: bool = False) -> None:
    """Meet every rank of the default group before it is destroyed: a rank that closes its
    gloo connections while a peer still finishes its last collective would fail that
    peer. The meeting is on the group's store, not a collective, so it cannot be confused
    with one a peer is still in, and it is bounded: a rank that ``failed`` only says so
    (its peers stop waiting for it) and a peer that never comes is waited for
    ``timeout_s`` at most."""
    if not dist.is_initialized() or dist.get_world_size() <= 1:
        return
    _exits[0] += 1
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = (f"ddpkit/leave/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                  f"{_exits[0]}/")
        store.set(prefix + str(dist.get_rank()), b"failed" if failed else b"ok")
        if not failed:
            store.wait([prefix + str(r) for r in range(dist.get_world_size())],
                       timedelta(seconds=timeout_s))
    except Exception as exc:  # a store that is gone, or a peer that never came
        log.debug(f"leaving the process group together: {exc}")


def release_torch_defaults() -> int:
    """Forget process groups that torch's own functions captured as default arguments.

    ``torch.distributed.nn.functional`` declares ``group=group.WORLD`` defaults, evaluated
    when the module is imported; imported after ``init_process_group`` (torch._dynamo
    imports it, and optimizers import torch._dynamo on their first step), they hold the
    default group for good, so ``destroy_process_group`` cannot free it and its gloo
    threads live on into finalization. ``None`` means the same group to those functions.
    Returns how many defaults were replaced."""
    replaced = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        functions = [f for f in vars(module).values() if type(f) is types.FunctionType]
        for fn in functions:
            defaults = fn.__defaults__
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d
                                        for d in defaults)
                replaced += 1
    return replaced


def exit_teardown(destroy_default: bool) -> None:
    """Everything ddpkit does at interpreter exit, before finalization: close what ddpkit
    built on every group; if ``destroy_default``, meet the other ranks (unless this
    program failed) and destroy the default group; drop the groups torch's own functions
    captured; collect cycles, so that groups nothing holds die now, while their threads
    can still take the GIL."""
    close_all()
    if destroy_default and dist.is_available() and dist.is_initialized():
        leave_together(failed=_ended_by_exception())
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    release_torch_defaults()
    gc.collect()


def _at_exit() -> None:
    exit_teardown(_destroy_default)


atexit.register(_at_exit)


# ----------------------------------------------------------------------------- launching


@contextlib.contextmanager
def no_python_tls() -> Iterator[None]:
    """Launch collectives in this block without autograd's stashed Python context in
    thread-local state (present inside backward), so the Works they create hold no
    Python object that a backend thread would have to free."""
    get = getattr(torch._C, "_get_obj_in_tls", None)
    has = getattr(torch._C, "_is_key_in_tls", None)
    if get is None or has is None or not has(_TLS_KEY):
        yield
        return
    stashed = get(_TLS_KEY)
    torch._C._remove_obj_from_tls(_TLS_KEY)
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls(_TLS_KEY, stashed)
