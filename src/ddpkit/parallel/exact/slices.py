"""Slices: one step's global batch cut into V pieces that do not depend on W.

Exact mode computes every step as V separate forward/backward passes ("slices") of
fixed shapes, and each rank of W runs the V/W slices it owns one after another. Which
samples a slice holds, which random numbers it draws and how many intra-op threads
compute it must then not depend on W; this module defines all three.

* **Samples.** Slice ``k`` of a global batch holds positions ``k, k + V, k + 2V, ...``
  of it. :class:`ddpkit.data.ShardSampler` gives rank ``r`` of W the positions
  ``r, r + W, ...``, so (with W dividing V) rank ``r`` owns slices ``r, r + W, ...``,
  and its ``m``-th slice is its local batch's entries ``m, m + V/W, ...``
  (:func:`slice_positions`). The last batch of an epoch is padded to a multiple of V
  (``ShardSampler(slices=V)``), so every slice of a step has the same size.
* **Random numbers.** Slice ``k`` of step ``s`` draws from torch's generators seeded
  with :func:`slice_seed` ``(seed, s, k)`` (:func:`slice_rng`), then the caller's
  streams are put back: dropout masks follow the slice, not the rank.
* **Numerics.** :func:`pin_numerics` fixes what changes a kernel's bits between
  layouts: the intra-op thread count (a reduction split over 2 threads rounds
  differently from 1; measured on this project's MLP) and torch's deterministic
  algorithms (CUDA's atomics-based kernels).

:func:`default_slices` picks V for a global batch (:mod:`ddpkit.slice_count`,
torch-free, so the launcher checks a run before any worker starts).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch

from ddpkit.errors import ConfigError
from ddpkit.slice_count import EXACT_THREADS

_MASK64 = (1 << 64) - 1


def owned_slices(rank: int, world_size: int, slices: int) -> range:
    """The global indices of the slices rank ``rank`` of ``world_size`` runs, in order."""
    return range(rank, slices, world_size)


def slice_positions(length: int, slices: int, world_size: int) -> list[slice]:
    """How a rank's local batch of ``length`` entries splits into its slices: entry
    ``j`` belongs to its ``j % (V/W)``-th slice (see the module docstring)."""
    per_rank = slices // world_size
    if length % per_rank:
        raise ConfigError(
            f"a local batch of {length} samples does not split into {per_rank} slices of "
            f"equal size: with {slices} slices the global batch must be a "
            f"multiple of {slices}, and the last batch of an epoch padded to one "
            f"(ShardSampler(..., slices={slices}))")
    return [slice(m, None, per_rank) for m in range(per_rank)]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def slice_seed(seed: int, step: int, slice: int) -> int:
    """A 64-bit seed for slice ``slice`` of step ``step`` of a run seeded ``seed``:
    distinct triples give unrelated seeds (splitmix64 chained over the three)."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (step & _MASK64))
    return _splitmix64(h ^ (slice & _MASK64))


def _generators(devices: Sequence[torch.device]) -> list[torch.Generator]:
    found = [torch.default_generator]
    for device in devices:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            found.append(torch.cuda.default_generators[index])
    return found


class _CallerStreams:
    """:func:`caller_streams`' context (a class: cheaper to enter than a generator's)."""

    def __init__(self, devices: Sequence[torch.device]):
        self.generators = _generators(devices)
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> list[torch.Generator]:
        self.saved = [g.get_state() for g in self.generators]
        return self.generators

    def __exit__(self, *exc: object) -> None:
        for g, state in zip(self.generators, self.saved):
            g.set_state(state)


def caller_streams(devices: Sequence[torch.device] = ()) -> _CallerStreams:
    """A context: inside, torch's CPU generator (and those of ``devices``' CUDA
    devices), to be seeded per slice with :func:`seed_slice`; afterwards they are back
    where they were (saved once for a step's slices, not once per slice)."""
    return _CallerStreams(devices)


def seed_slice(generators: Sequence[torch.Generator], seed: int, step: int,
               slice: int) -> int:
    """Seed ``generators`` for slice ``slice`` of step ``step``; returns the seed.

    (The generators are seeded directly: ``torch.manual_seed`` also queues a seed for
    every accelerator type, with a stack trace each, which costs far more than seeding
    a generator, once per slice.)"""
    value = slice_seed(seed, step, slice)
    for g in generators:
        g.manual_seed(value)
    return value


@contextlib.contextmanager
def slice_rng(seed: int, step: int, slice: int,
              devices: Sequence[torch.device] = ()) -> Iterator[int]:
    """Inside: torch's CPU generator (and those of ``devices``' CUDA devices) seeded
    for this slice; afterwards they are back where they were. Yields the seed."""
    with caller_streams(devices) as generators:
        yield seed_slice(generators, seed, step, slice)


def pin_numerics(threads: int = EXACT_THREADS, *, cuda: bool = False) -> None:
    """Fix what makes a kernel's bits depend on the process layout: ``threads``
    intra-op threads, deterministic algorithms (warn-only: an op without a
    deterministic version still runs, and torch warns), and on CUDA the cuBLAS
    workspace setting deterministic algorithms need."""
    if threads < 1:
        raise ConfigError(f"exact mode needs at least one intra-op thread, got {threads}")
    torch.set_num_threads(threads)
    if cuda:
        # cuBLAS reads this when it creates a handle; set before any CUDA matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


__all__ = ["caller_streams", "owned_slices", "pin_numerics", "seed_slice", "slice_positions",
           "slice_rng", "slice_seed"]
