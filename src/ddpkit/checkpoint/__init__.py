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

from ddpkit.checkpoint._dist import local_device
from ddpkit.checkpoint.cadence import Cadence
from ddpkit.checkpoint.collect import collect_state, restore_state
from ddpkit.checkpoint.dcp_load import load_dcp, read_model_state
from ddpkit.checkpoint.fingerprint import config_changes, config_fingerprint
from ddpkit.checkpoint.model_state import (
    check_model_state,
    load_model_state,
    strip_module_prefix,
    unwrap,
)
from ddpkit.checkpoint.rng import gather_rng_states, rng_state, set_rng_state
from ddpkit.checkpoint.store import FORMAT, Checkpointer, CheckpointError, CheckpointInfo

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
