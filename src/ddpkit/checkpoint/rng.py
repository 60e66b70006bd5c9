"""Per-rank random number streams (torch, CUDA, numpy, python) in types a
``weights_only=True`` load accepts."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.checkpoint._dist import _initialized, _rank, _world_size


def rng_state() -> dict[str, Any]:
    """This process's torch/numpy/python RNG states in weights_only-loadable types."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    npst = state["numpy"]
    keys = npst["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state(
        (npst["kind"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def gather_rng_states() -> list[dict[str, Any]] | None:
    """Collective: every rank's RNG state, by rank, on rank 0 (None elsewhere).

    Ranks draw different random numbers (dropout masks, augmentation), so a resume that
    restored one stream everywhere would not continue the same run.
    """
    mine = rng_state()
    if not _initialized():
        return [mine]
    gathered: list[Any] | None = [None] * _world_size() if _rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered
