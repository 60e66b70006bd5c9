"""What ``algo="auto"`` (and ``DataParallel(comm="auto")``) runs: decided once per group.

Stable API (other modules resolve "auto" through these functions):

``choose_algo(device_type, same_host, world_size, *, shm_ok=True, max_local=None) -> str``
    The pure decision, no communication. Returns one of

    * ``"backend"`` - torch's own collective on the group's backend: every non-CPU
      tensor (CUDA goes to NCCL), a group of one rank (nothing to move), shared memory
      unusable on some rank (``shm_ok=False``), or ranks spread over hosts one per host
      (``max_local == 1``: nothing to share);
    * ``"shm"`` - CPU tensors and every rank of the group on one host;
    * ``"hierarchical"`` - CPU tensors, ranks on several hosts with at least two on one:
      shared memory inside each host, the backend between one leader per host.

``algo_for(group, device) -> str``
    ``choose_algo`` for a process group (None = the default group) and a tensor device
    (``torch.device``, a device string such as ``"cuda:0"``, or a tensor). Non-CPU
    devices resolve to ``"backend"`` without any exchange. For CPU the first call on a
    group exchanges each rank's host identity and shared-memory usability once
    (``dist.all_gather_object`` on the group, so every rank of the group must make
    that first call, as every rank does when it runs the same collective); the answer
    is cached per (group, device type) and later calls are a dictionary lookup. A new
    default process group (``init_process_group`` again) starts a fresh cache.

``layout(group) -> Layout``
    What that one exchange learned about a group (its size, whether every rank is on
    one host, whether every rank can use shared memory, the most ranks on one host), for
    a caller that decides more than an algorithm (DataParallel's ``comm=``); collective
    on the first call per group, cached after, as ``algo_for``.

Host identity is :func:`ddpkit.comm.shm.host_key` (hostname + boot id), overridable per
rank with ``$DDPKIT_HOST_ID``: tests use it to fake a two-host split on one machine.
The decision never depends on the tensor's dtype, size or the call's arguments, so a
rank whose call is malformed still lands in the same engine as its peers and can refuse
there (in-band), instead of waiting in a different one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit.comm import groups
from ddpkit.comm.shm import segment
from ddpkit.comm.shm.communicator import host_key
from ddpkit.comm.shm.sync import memory_model_ok
from ddpkit.errors import CommError
from ddpkit.runtime import lifetime

ALGOS = ("shm", "hierarchical", "backend")


def choose_algo(
    device_type: str,
    same_host: bool,
    world_size: int,
    *,
    shm_ok: bool = True,
    max_local: int | None = None,
) -> str:
    """The algorithm "auto" means for this device type and group layout (pure)."""
    if device_type != "cpu" or world_size <= 1 or not shm_ok:
        return "backend"
    if same_host:
        return "shm"
    if max_local is not None and max_local <= 1:
        return "backend"
    return "hierarchical"


@dataclass(frozen=True)
class Layout:
    """What the one-time exchange learned about a group."""

    world_size: int
    same_host: bool
    shm_ok: bool
    max_local: int  # most ranks of the group on one host


_lock = threading.Lock()
_layouts = lifetime.PerGroup()  # group -> Layout
_choices = lifetime.PerGroup()  # group -> {device type: algorithm name}


def _device_type(device) -> str:
    if isinstance(device, torch.Tensor):
        return device.device.type
    if isinstance(device, torch.device):
        return device.type
    return torch.device(device).type


def shm_usable_here() -> bool:
    return segment.available() and memory_model_ok()


def layout(group=None) -> Layout:
    """The group's host layout (collective on first call per group, cached after)."""
    with _lock:
        found = _layouts.get(group)
    if found is not None:
        return found
    view = groups.view(group)
    if view is None:
        raise CommError("this rank is not a member of the group it asked about")
    rows: list = [None] * view.size
    dist.all_gather_object(rows, (host_key(), shm_usable_here()), group=group)
    counts: dict[str, int] = {}
    for host, _ in rows:
        counts[host] = counts.get(host, 0) + 1
    found = Layout(view.size, len(counts) == 1, all(ok for _, ok in rows), max(counts.values()))
    with _lock:
        _layouts.set(group, found)
    return found


def algo_for(group=None, device="cpu") -> str:
    """``choose_algo`` for ``group`` and ``device``, decided once and cached (see module
    docstring: the first CPU call on a group is collective)."""
    dtype = _device_type(device)
    with _lock:
        found = _choices.get(group, {}).get(dtype)
    if found is not None:
        return found
    if dtype != "cpu":
        found = "backend"
    else:
        lay = layout(group)
        found = choose_algo(dtype, lay.same_host, lay.world_size, shm_ok=lay.shm_ok,
                            max_local=lay.max_local)
    with _lock:
        per_device = _choices.get(group)
        if per_device is None:
            per_device = {}
            _choices.set(group, per_device)
        per_device[dtype] = found
    return found


def forget() -> None:
    """Drop every cached decision (tests; a process that changes its host identity)."""
    with _lock:
        _layouts.clear()
        _choices.clear()
