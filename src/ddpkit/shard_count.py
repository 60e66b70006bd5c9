"""How many virtual shards an exact-mode step has: the default, and the checks.

Exact mode (docs/exact.md) cuts every global batch into V shards; W ranks run V/W each,
so a run can use exactly the world sizes that divide V, and V must divide the global
batch. Plain arithmetic without torch: ``ddpkit train --exact`` checks a run with it
before any worker starts.
"""

from __future__ import annotations

from ddpkit.errors import ConfigError

# Each shard is one forward/backward: past a dozen, a step pays more in per-pass cost
# than it gains in world sizes it can run on (12 already serves W = 1, 2, 3, 4, 6, 12).
MAX_DEFAULT_SHARDS = 12
# Intra-op threads per process in exact mode: a kernel's bits may depend on how many
# threads split it, so every layout uses the same count (the caller may pick another).
EXACT_THREADS = 1


def world_sizes(virtual_shards: int) -> list[int]:
    """The world sizes a run with this many shards can use (the divisors of V)."""
    return [w for w in range(1, virtual_shards + 1) if virtual_shards % w == 0]


def default_virtual_shards(global_batch_size: int) -> int:
    """The divisor V <= 12 of the global batch that the most world sizes divide (the
    smallest such V on ties: fewer, larger shards are faster). 96 -> 12 (W = 1, 2, 3,
    4, 6, 12), 128 -> 8, 100 -> 10, 7 -> 7."""
    if global_batch_size < 1:
        raise ConfigError(f"global batch size must be >= 1, got {global_batch_size}")
    candidates = [v for v in range(1, MAX_DEFAULT_SHARDS + 1) if global_batch_size % v == 0]
    return max(candidates, key=lambda v: (len(world_sizes(v)), -v))


def check_virtual_shards(virtual_shards: int, global_batch_size: int | None,
                         world_size: int | None) -> int:
    """``virtual_shards`` if it fits the global batch and the world size (either may be
    None: not known yet), else one ConfigError line saying what to choose."""
    v = virtual_shards
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"virtual shards must be a positive integer, got {v!r}")
    if global_batch_size is not None and global_batch_size % v:
        raise ConfigError(
            f"{v} virtual shards do not divide the global batch of {global_batch_size}; "
            f"use a divisor of it (e.g. {default_virtual_shards(global_batch_size)})")
    if world_size is not None and v % world_size:
        sizes = ", ".join(map(str, world_sizes(v)))
        raise ConfigError(
            f"exact mode with {v} virtual shards runs on {sizes} processes, not "
            f"{world_size}: choose one of those, or a shard count that {world_size} "
            "divides (--virtual-shards)")
    return v


__all__ = ["EXACT_THREADS", "MAX_DEFAULT_SHARDS", "check_virtual_shards", "default_virtual_shards",
           "world_sizes"]
