"""How many slices an exact-mode step has: the default, and the checks.

Exact mode (docs/exact.md) cuts every global batch into V slices; W ranks run V/W each,
so a run can use exactly the world sizes that divide V, and V must divide the global
batch. Plain arithmetic without torch: ``ddpkit train --exact`` checks a run with it
before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit.errors import ConfigError

# Each slice is one forward/backward: past a dozen, a step pays more in per-pass cost
# than it gains in world sizes it can run on (12 already serves W = 1, 2, 3, 4, 6, 12).
MAX_DEFAULT_SLICES = 12
# Intra-op threads per process in exact mode: a kernel's bits may depend on how many
# threads split it, so every layout uses the same count (the caller may pick another).
EXACT_THREADS = 1


def world_sizes(slices: int) -> list[int]:
    """The world sizes a run with this many slices can use (the divisors of V)."""
    return [w for w in range(1, slices + 1) if slices % w == 0]


def default_slices(global_batch_size: int) -> int:
    """The divisor V <= 12 of the global batch that the most world sizes divide (the
    smallest such V on ties: fewer, larger slices are faster). 96 -> 12 (W = 1, 2, 3,
    4, 6, 12), 128 -> 8, 100 -> 10, 7 -> 7."""
    if global_batch_size < 1:
        raise ConfigError(f"global batch size must be >= 1, got {global_batch_size}")
    candidates = [v for v in range(1, MAX_DEFAULT_SLICES + 1) if global_batch_size % v == 0]
    return max(candidates, key=lambda v: (len(world_sizes(v)), -v))


def check_slices(slices: int, global_batch_size: int | None,
                         world_size: int | None) -> int:
    """``slices`` if it fits the global batch and the world size (either may be
    None: not known yet), else one ConfigError line saying what to choose."""
    v = slices
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"slices must be a positive integer, got {v!r}")
    if global_batch_size is not None and global_batch_size % v:
        raise ConfigError(
            f"{v} slices do not divide the global batch of {global_batch_size}; "
            f"use a divisor of it (e.g. {default_slices(global_batch_size)})")
    if world_size is not None and v % world_size:
        sizes = ", ".join(map(str, world_sizes(v)))
        raise ConfigError(
            f"exact mode with {v} slices runs on {sizes} processes, not "
            f"{world_size}: choose one of those, or a slice count that {world_size} "
            "divides (--slices)")
    return v


def saved_slice_count(state: Mapping[str, Any]) -> int:
    """The slice count an exact-mode checkpoint's state was written with (checkpoints
    written before the unit was called a slice name it ``virtual_shards``)."""
    return int(state["slices"] if "slices" in state else state["virtual_shards"])


__all__ = ["EXACT_THREADS", "MAX_DEFAULT_SLICES", "check_slices", "default_slices",
           "saved_slice_count",
           "world_sizes"]
