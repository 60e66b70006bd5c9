"""Checkpoints that survive crashes: rank 0 writes atomically, every rank loads safely.

* ``store``: :class:`Checkpointer` writes, verifies, lists, rotates and loads
  checkpoint files (atomic, fsynced, checksummed, ``weights_only`` loads, collective).
* ``cadence``: :class:`Cadence`, when the next checkpoint is due (steps and/or seconds).
* ``collect``: :func:`collect_state` / :func:`restore_state` build and apply the
  training state: the unwrapped model, optimizer, LR scheduler, sampler position,
  per-rank RNG streams, step/epoch, world size and a config fingerprint.
* its parts: ``model_state`` (unwrap, ``module.`` prefixes, key-by-key model checks),
  ``rng`` (per-rank random streams), ``fingerprint`` (config hashes and differences).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it, imported on first use: the writing and loading
# modules import torch's DCP (most of a second), which the launcher's look at a finished
# run (the checkpoints' manifests) does not need.
_WHERE = {
    "local_device": "_dist",
    "Cadence": "cadence",
    "collect_state": "collect",
    "restore_state": "collect",
    "load_dcp": "dcp_load",
    "read_model_state": "dcp_load",
    "config_changes": "fingerprint",
    "config_fingerprint": "fingerprint",
    "check_model_state": "model_state",
    "load_model_state": "model_state",
    "strip_module_prefix": "model_state",
    "unwrap": "model_state",
    "gather_rng_states": "rng",
    "rng_state": "rng",
    "set_rng_state": "rng",
    "FORMAT": "store",
    "Checkpointer": "store",
    "CheckpointError": "store",
    "CheckpointInfo": "store",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # looked up once
    return value


__all__ = [
    "FORMAT",
    "Cadence",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "check_model_state",
    "collect_state",
    "config_changes",
    "config_fingerprint",
    "gather_rng_states",
    "load_dcp",
    "load_model_state",
    "local_device",
    "read_model_state",
    "restore_state",
    "rng_state",
    "set_rng_state",
    "strip_module_prefix",
    "unwrap",
]
