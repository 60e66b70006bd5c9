"""Asynchronous ddpkit collectives: handles, and one background lane per process group.

A ring written in Python cannot run inside the backend's own threads, so an
``async_op=True`` call of a Python algorithm is queued to a background thread (a
"lane") and returns at once. The lane talks on a *companion* process group with the
same ranks, so its point-to-point messages and agreement checks can never be matched
against the caller's own operations on the original group, which keep running
meanwhile.

Ordering rule: a group's async calls run one after another in the order they were
issued, so every rank must issue its async calls on a group in the same order (as
with torch's collectives). Sync and async calls do not need a common order.

Companion groups are created collectively (``dist.new_group`` must be called by every
rank of the job, in the same order): lazily at the first async call for the default
group, and inside :func:`new_group` for subgroups.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import CommError
from ddpkit.runtime import lifetime


class CommHandle:
    """What an ``async_op=True`` call returns: ``wait()`` blocks until the result is in
    place and returns it; ``get_future()`` is a ``torch.futures.Future`` of that value."""

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def wait(self, timeout: float | None = None) -> Any:
        # A timeout belongs to the process group (ddpkit.init(timeout=...)); accepted
        # for signature compatibility with torch's Work.wait.
        return self._future.wait()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


def completed(value: Any) -> CommHandle:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return CommHandle(fut)


class _Lane:
    """One daemon thread running queued calls in order on one companion group."""

    def __init__(self, companion: dist.ProcessGroup):
        self.companion = companion
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="ddpkit-comm-lane", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Any], Any]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((fn, fut))
        return fut

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            try:
                value = fn(self.companion)
            except Exception as exc:  # delivered to whoever waits on the future
                fut.set_exception(exc)
            else:
                fut.set_result(value)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


class _Companion:
    """The companion group ddpkit made for one group, and its lane once started."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.lane: _Lane | None = None

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        registered = dist.is_initialized() and self.group in dist.distributed_c10d._world.pg_map
        if registered:
            with contextlib.suppress(ValueError, RuntimeError):
                dist.destroy_process_group(self.group)
        self.group = None  # the last reference: the companion's backend threads are joined


# group -> its companion; dropped (lane stopped, companion destroyed) when the group dies
_companions = lifetime.PerGroup(on_drop=_Companion.close)
_lock = threading.Lock()


def new_group(ranks: Sequence[int] | None = None, **kwargs) -> dist.ProcessGroup:
    """``dist.new_group`` plus the companion group async ddpkit calls on it need.

    Like ``dist.new_group``, every rank of the job must call it, in the same order,
    including ranks that are not members.
    """
    group = dist.new_group(ranks, **kwargs)
    companion = dist.new_group(ranks, **kwargs)
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        with _lock:
            _companions.set(group, _Companion(companion))
    return group


def lane(group) -> _Lane:
    """The lane for ``group``; the default group's companion is made on first use."""
    with _lock:
        found = _companions.get(group)
        if found is None:
            if group is not None and group != dist.group.WORLD:
                raise CommError(
                    "async_op=True with a Python algorithm needs a group made by "
                    "ddpkit.comm.new_group(ranks) (it creates the companion group the "
                    "background lane talks on); or use async_op=False or algo='backend'"
                )
            found = _Companion(dist.new_group())
            _companions.set(group, found)
        if found.lane is None:
            found.lane = _Lane(found.group)
        return found.lane


def close_lanes() -> None:
    """Stop every lane's thread and destroy the companion groups (collective: call it on
    every rank, after waiting for outstanding async calls)."""
    with _lock:
        _companions.clear()
