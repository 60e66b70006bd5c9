"""Process-group life cycle: one idempotent init, one teardown that always runs.

The backend follows the device (``get_default_backend_for_device``: nccl on CUDA, gloo
on CPU, ...), so the same program runs on a laptop in tests and on GPUs in production.
A single process with no launcher still gets a real (world size 1) process group, so
code never needs an ``if distributed:`` branch around its collectives.
"""

from __future__ import annotations

import contextlib
import gc
import re
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger
from ddpkit.runtime import lifetime
from ddpkit.runtime.world import World

log = get_logger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)
_INIT_SCHEMES = ("env://", "tcp://", "file://")

_world: World | None = None  # what init() set up in this process, if anything
_groups_built = 0  # default groups init() built in this process; later ones get fresh keys


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds <= 0:
        raise ConfigError(f"timeout must be positive, got {seconds} s")
    return timedelta(seconds=seconds)


def resolve_backend(backend: str, device: str) -> str:
    if backend != "auto":
        if backend not in ("gloo", "nccl", "mpi", "xccl", "ucc") and ":" not in backend:
            raise ConfigError(f"unknown backend {backend!r}; use auto, gloo, nccl or mpi")
        if backend == "mpi" and not dist.is_mpi_available():
            raise ConfigError(
                "backend 'mpi' needs a torch built with MPI; use gloo, or build torch with MPI"
            )
        return backend
    return dist.get_default_backend_for_device(torch.device(device))


def init(
    backend: str = "auto",
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    world: World | None = None,
    devices_per_process: int = 1,
) -> World:
    """Join the job's process group and return this process's :class:`World`.

    ``init_method``: ``env://`` (default; MASTER_ADDR/MASTER_PORT), ``tcp://host:port``
    or ``file:///shared/path``. ``timeout`` bounds every collective: give stragglers
    enough room (PyTorch's DDP tutorial warns of their timeouts), but not so much that a
    dead peer hangs the job for hours.
    Calling init again returns the same World.
    """
    global _world, _groups_built
    if dist.is_initialized():
        if _world is None:  # someone else (a user's own init) created the group
            _world = World.from_env(require_master_addr=False)
        return _world
    if init_method is not None and not init_method.startswith(_INIT_SCHEMES):
        raise ConfigError(
            f"init method {init_method!r} is not one of env://, tcp://host:port, file:///path"
        )
    rendezvous_elsewhere = init_method is not None and not init_method.startswith("env://")
    world = world or World.from_env(
        devices_per_process=devices_per_process, require_master_addr=not rendezvous_elsewhere
    )
    backend = resolve_backend(backend, world.device)
    device = torch.device(world.device)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    kwargs = dict(
        backend=backend,
        rank=world.rank,
        world_size=world.world_size,
        timeout=_as_timedelta(timeout),
    )
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init: errors surface here, not at first use
    if init_method is None and world.world_size == 1 and world.master_addr is None:
        # No launcher: a private in-memory store makes a real group of one.
        dist.init_process_group(store=dist.HashStore(), **kwargs)
    else:
        try:
            if _groups_built:
                dist.init_process_group(store=_store_for_another_group(init_method, kwargs),
                                        **kwargs)
            else:
                dist.init_process_group(init_method=init_method or "env://", **kwargs)
        except (dist.DistNetworkError, dist.DistStoreError) as err:
            raise _rendezvous_error(err, world, init_method, kwargs["timeout"]) from err
    _world = world
    _groups_built += 1
    lifetime.destroy_default_group_at_exit()
    log.debug(f"initialized {backend} process group: {world}")
    return world


def _store_for_another_group(init_method: str | None, kwargs: dict) -> dist.Store:
    """The job's store (torch's rendezvous), under keys no earlier group of this process
    used.

    torch names the default group's keys by a counter that ``destroy_process_group``
    resets, so a group built again on a store that outlived the last one (torchrun's
    agent store lives as long as the launch) finds the addresses the previous group's
    ranks published: gloo connects to closed sockets and fails, or waits
    (pytorch/pytorch#55967). Every rank builds its groups in the same order, so the
    count names the same fresh keys on every rank.
    """
    store, _, _ = next(dist.rendezvous(init_method or "env://", kwargs["rank"],
                                       kwargs["world_size"], timeout=kwargs["timeout"]))
    store.set_timeout(kwargs["timeout"])
    return dist.PrefixStore(f"ddpkit/group{_groups_built}", store)


def _rendezvous_error(err: Exception, world: World, init_method, timeout: timedelta) -> Exception:
    """Turn torch's rendezvous failures that users cause into one line that says the fix."""
    text = str(err)
    where = (
        init_method or f"env:// (MASTER_ADDR={world.master_addr} MASTER_PORT={world.master_port})"
    )
    if "EADDRINUSE" in text or "address already in use" in text:
        return ConfigError(
            f"rank 0 cannot host the store: port already in use at {where}; "
            "pick a free MASTER_PORT, or let `ddpkit launch` pick one"
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        return ConfigError(
            f"only {joined.group(1)} of WORLD_SIZE={world.world_size} processes joined within "
            f"{timeout.total_seconds():.0f} s at {where}; start every rank, or fix WORLD_SIZE"
        )
    return err


def shutdown() -> None:
    """Destroy the process group if one exists; safe to call any number of times."""
    global _world
    if dist.is_available() and dist.is_initialized():
        # What ddpkit built on the groups (lanes, companion groups, shared-memory
        # communicators) is closed as the groups die; a group that torch's own function
        # defaults captured is let go, so its backend threads are joined now
        # (ddpkit.runtime.lifetime).
        dist.destroy_process_group()
        lifetime.release_torch_defaults()
        gc.collect()
    _world = None


def current_world() -> World | None:
    return _world


@contextlib.contextmanager
def distributed(
    backend: str = "auto",
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    **kwargs,
) -> Iterator[World]:
    """``with ddpkit.distributed() as world:`` - init on entry, teardown on any exit.

    Only a group this call created is destroyed: nesting inside a caller's own init
    leaves the caller's group alone.
    """
    owned = not dist.is_initialized()
    world = init(backend, init_method, timeout, **kwargs)
    try:
        yield world
    except BaseException:
        if owned:
            shutdown()
        raise
    if owned:
        lifetime.leave_together()
        shutdown()
