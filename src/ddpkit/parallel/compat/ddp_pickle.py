"""Pickling a DataParallel: ``torch.save(model)``, ``torch.load``, ``copy.deepcopy(model)``.

What torch's DistributedDataParallel does, and so what DataParallel does: the pickled
state is the wrapper's settings and the wrapped module; the live machinery (the process
group handle, the reducer with its autograd hooks and buckets, the transport with its
shared-memory segment, the logging data) is left out and built again when the object is
loaded, against the default process group. Only a model built on the default group can
be pickled (torch raises RuntimeError for any other group, and so does DataParallel).
A comm hook given to the constructor (``comm_hook=``/``comm=hook``) travels with the
settings; one registered later with ``register_comm_hook`` does not, as with torch.

Loading must not communicate (one rank may deep-copy a model alone), but setting up
shared memory is collective. So a copy whose transport was chosen collectively (``comm=
"auto"`` or ``"shm"`` on CPU) gets a :class:`LazyTransport`: its buckets stay in private
memory and the transport is created at its first collective (the first forward that
synchronizes buffers or gradients), which every rank reaches together anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import UsageError
from ddpkit.parallel.engine.buckets import default_allocator
from ddpkit.parallel.engine_options import EngineOptions

# Where the pickled state keeps the engine's options.
PICKLED_OPTIONS = "_engine_options"
# Live objects that are rebuilt on load rather than pickled.
TRANSIENT = ("reducer", "sparse", "transport", "process_group", "group", "_logging",
             "_join_state", "_torch_join_state", "_buffers_to_sync", "_sharding")


def pickled_state(model: Any) -> dict:
    """``__getstate__``: the settings and the module, without the live machinery."""
    group = model.group
    default = dist.distributed_c10d._get_default_group()
    if group is not None and group is not default:
        raise UsageError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default "
            "process group; this DataParallel was built on another group (pickle the "
            "wrapped module, model.module, instead)")
    if model.shard != "none":
        # The optimizer holds this rank's shards of the live model; a copy would cut new
        # ones that no optimizer holds.
        raise UsageError(
            f"a DataParallel(shard={model.shard!r}) cannot be pickled or copied: pickle "
            "model.module (after model.gather_parameters()) or use shard='none'")
    if model.exact is not None:
        # The exact reducer's rows and random streams belong to the live run.
        raise UsageError("a DataParallel(exact=True) cannot be pickled or copied: pickle "
                         "model.module instead")
    state = dict(model.__dict__)
    for key in TRANSIENT:
        state.pop(key, None)
    # The engine's options travel as a plain dict (the fields a copy needs: it is never
    # sharded nor exact), so that a pickle names no ddpkit class but DataParallel, whose
    # path (ddpkit.parallel.ddp) is what torch.load looks up.
    options = state.pop("_options")
    state[PICKLED_OPTIONS] = {
        "comm": options.comm, "comm_hook": options.comm_hook, "comm_state": options.comm_state,
        "limits": list(options.limits), "initial_bucketing": options.initial_bucketing}
    return state


def loaded_options(state: dict) -> EngineOptions:
    """``__setstate__``: the engine's options back from what :func:`pickled_state` left."""
    saved = state.pop(PICKLED_OPTIONS)
    hook = saved["comm_hook"]
    return EngineOptions(comm="backend" if hook is not None else saved["comm"], comm_hook=hook,
                         comm_state=saved["comm_state"], limits=tuple(saved["limits"]),
                         initial_bucketing=saved["initial_bucketing"], shard="none",
                         exact=False, slices=None)


class LazyTransport:
    """A transport whose (collective) creation waits for its first collective."""

    reduces_inline = False  # the reducer launches buckets as they fill

    def __init__(self, build: Callable[[], Any]):
        self._build = build
        self._real = None

    @property
    def name(self) -> str:
        return self._real.name if self._real is not None else "pending"

    def _transport(self):
        if self._real is None:
            self._real = self._build()
        return self._real

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return default_allocator(numel, dtype, device)

    def all_reduce(self, buffer: torch.Tensor):
        return self._transport().all_reduce(buffer)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int, *,
                  every_step: bool = False) -> None:
        self._transport().broadcast(tensors, src, every_step=every_step)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._transport().sum_(tensor)

    def close(self) -> None:
        if self._real is not None:
            self._real.close()
