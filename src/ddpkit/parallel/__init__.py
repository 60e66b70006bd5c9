"""Data parallelism: ddpkit's own DDP engine, its hooks, and a one-flag switch to torch's.

``data_parallel(model, engine="ddpkit" | "torch", **options)`` is what programs call, so
the same training script runs on either engine (the benchmarks compare them that way).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ddpkit.comm.shm import ShmState, shm_hook
from ddpkit.errors import ConfigError
from ddpkit.parallel.ddp import DataParallel
from ddpkit.parallel.grad_bucket import GradBucket
from ddpkit.parallel.hooks import ring_hook
from ddpkit.parallel.join import join
from ddpkit.vocabulary import COMM_CHOICES, ENGINES, SHARD_CHOICES

_OPTIONS = ("bucket_cap_mb", "broadcast_buffers", "find_unused_parameters", "comm_hook",
            "comm_state", "group", "first_bucket_cap_mb", "initial_bucketing", "comm", "shard",
            "exact", "slices")


def data_parallel(module: nn.Module, engine: str = "ddpkit", **options: Any) -> nn.Module:
    """Wrap ``module`` for data-parallel training with the chosen engine.

    Both engines expose ``.module`` and ``.no_sync()`` and work with :func:`ddpkit.join`.
    Options: ``bucket_cap_mb``, ``broadcast_buffers``, ``find_unused_parameters``,
    ``comm_hook``, ``comm_state``, ``group``, ``comm`` (and ``first_bucket_cap_mb``,
    ``initial_bucketing``, ``shard``, ``exact``, ``slices`` for ddpkit). ``comm``
    under torch's engine: ``"auto"`` and ``"backend"`` leave torch's reducer as it is;
    ``"shm"`` and ``"ring"`` register ddpkit's shared-memory or ring hook on it.
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown data_parallel option(s) {unknown}; valid: {', '.join(_OPTIONS)}")
    if engine == "ddpkit":
        if "broadcast_buffers" in options:  # torch 2.13's name for it (the old one warns)
            options["forward_sync_buffers"] = options.pop("broadcast_buffers")
        return DataParallel(module, **options)
    if engine == "torch":
        if options.pop("exact", False) or options.pop("slices", None) is not None:
            raise ConfigError("exact mode is ddpkit's engine's: data_parallel(model, "
                              "engine='ddpkit', exact=True)")
        return _torch_ddp(module, **options)
    raise ConfigError(f"unknown DDP engine {engine!r}; use one of {', '.join(ENGINES)}")


def _torch_ddp(
    module: nn.Module,
    *,
    bucket_cap_mb: float | None = None,
    broadcast_buffers: bool = True,
    find_unused_parameters: bool = False,
    comm_hook=None,
    comm_state=None,
    group=None,
    first_bucket_cap_mb: float | None = None,
    initial_bucketing: str | None = None,
    comm: str = "auto",
    shard: str = "none",
) -> nn.Module:
    # torch's own class, also where ddpkit's engine stands behind torch's name (torch_swap)
    from ddpkit.parallel.compat.torch_swap import TORCH_DDP as DistributedDataParallel

    if first_bucket_cap_mb is not None or initial_bucketing is not None:
        raise ConfigError("first_bucket_cap_mb and initial_bucketing are ddpkit engine options; "
                          "torch's DDP lays out its buckets itself")
    if comm not in COMM_CHOICES:
        raise ConfigError(f"comm must be one of {', '.join(COMM_CHOICES)}, got {comm!r}")
    if shard != "none":
        raise ConfigError(f"shard={shard!r} is a ddpkit engine option; torch's DDP does not "
                          "shard (torch's ZeroRedundancyOptimizer shards the optimizer state)")
    if comm in ("shm", "ring") and comm_hook is not None:
        raise ConfigError(f"comm={comm!r} and comm_hook both choose how buckets are reduced; "
                          "pass one of them")
    if comm == "shm":
        comm_hook, comm_state = shm_hook, ShmState(group)
    elif comm == "ring":
        comm_hook = ring_hook
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (the old name warns).
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    buffers_option = ("forward_sync_buffers" if "forward_sync_buffers" in params
                      else "broadcast_buffers")
    model = DistributedDataParallel(
        module,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        process_group=group,
        **{buffers_option: broadcast_buffers},
    )
    if comm_hook is not None:
        model.register_comm_hook(comm_state, comm_hook)
    return model


__all__ = ["SHARD_CHOICES", "DataParallel", "GradBucket", "data_parallel", "join"]
