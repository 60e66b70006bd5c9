"""Who reads which samples: the tutorial's DataPartitioner and a resumable ShardSampler.

``DataPartitioner`` is the helper of PyTorch's distributed tutorial: shuffle the indices
once with a seeded ``random.Random`` and cut them into fractional partitions; ``use(i)`` is a view.

``ShardSampler`` is what a data-parallel loop needs on top of that:

* **Fixed global batch.** One optimizer step consumes ``global_batch_size`` consecutive
  positions of the epoch's order, whatever the world size; each rank reads
  ``global_batch_size // world_size`` of them. The layout is strided (rank ``r`` reads
  positions ``r, r + W, r + 2W, ...``), so after every rank has read ``k`` samples the
  job as a whole has consumed exactly the first ``k * W`` positions. That prefix
  property is what makes the position *global*: a saved position can be resumed with a
  different world size, and W processes see the same global batches as one process.
* **Equal, disjoint, complete shards (padding).** When the epoch does not divide, the
  last global batch is padded up to a multiple of the world size by repeating samples
  from the start of the order, so every rank runs the same number of steps (no rank
  waits forever in a collective). Each batch says how many of its entries are real, so
  metrics and the loss never count a padded sample. ``drop_last=True`` instead drops the
  final incomplete global batch. With ``slices=V`` (exact mode) it is padded to
  a multiple of V instead, so the batch cuts into V equal shards whatever the world
  size (W divides V).
* **New order every epoch, automatically.** The order is a permutation drawn from
  ``(seed, epoch)``; finishing an epoch moves the sampler to the next one, so users do
  not need ``set_epoch`` (it exists for explicit control).
* **Exact resume.** ``state_dict()`` holds ``(epoch, position)``, where position is the
  number of global positions consumed; ``load_state_dict`` continues at the very next
  sample, with any world size.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ddpkit.errors import ConfigError

__all__ = ["DataPartitioner", "Partition", "ShardBatch", "ShardSampler", "local_batch_size"]


class Partition(torch.utils.data.Dataset):
    """A view of ``data`` through a list of indices."""

    def __init__(self, data: Any, index: Sequence[int]):
        self.data = data
        self.index = list(index)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        return self.data[self.index[i]]


class DataPartitioner:
    """The tutorial's partitioner: one seeded shuffle, then consecutive fractional cuts.

    ``sizes`` are fractions of the dataset (``[1 / W] * W`` for W ranks); a fraction's
    partition has ``int(frac * len(data))`` samples, as in the tutorial, so a remainder
    of fewer than ``len(sizes)`` samples may go unused.
    """

    def __init__(self, data: Any, sizes: Sequence[float] = (0.7, 0.2, 0.1), seed: int = 1234):
        if not sizes or any(not 0 <= f <= 1 for f in sizes):
            raise ConfigError(f"partition sizes must be fractions in [0, 1], got {list(sizes)}")
        if sum(sizes) > 1 + 1e-9:
            raise ConfigError(f"partition sizes add up to {sum(sizes):g} > 1: {list(sizes)}")
        self.data = data
        indexes = list(range(len(data)))
        random.Random(seed).shuffle(indexes)
        self.partitions: list[list[int]] = []
        for frac in sizes:
            part_len = int(frac * len(data))
            self.partitions.append(indexes[:part_len])
            indexes = indexes[part_len:]

    def use(self, partition: int) -> Partition:
        if not 0 <= partition < len(self.partitions):
            raise ConfigError(
                f"partition {partition} does not exist; there are {len(self.partitions)}"
            )
        return Partition(self.data, self.partitions[partition])


def local_batch_size(global_batch_size: int, world_size: int) -> int:
    """Per-rank batch for a fixed global batch; a remainder would change the global batch."""
    if global_batch_size < 1:
        raise ConfigError(f"global batch size must be >= 1, got {global_batch_size}")
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if global_batch_size % world_size:
        lower = global_batch_size - global_batch_size % world_size
        raise ConfigError(
            f"global batch size {global_batch_size} is not divisible by world size "
            f"{world_size}; use a multiple of {world_size} (e.g. {lower or world_size}) "
            "so every rank reads the same number of samples per step"
        )
    return global_batch_size // world_size


@dataclass(frozen=True)
class ShardBatch:
    """One rank's share of one global batch.

    ``indices[:num_real]`` are real samples; the rest (only ever in the last batch of an
    epoch) are padding that keeps shards equal and must not be counted. ``global_num_real``
    is the number of real samples in the whole global batch, identical on every rank, so a
    rank can weight its loss to make the averaged gradient the exact global mean.
    """

    indices: list[int]
    num_real: int
    global_num_real: int
    epoch: int
    step: int  # index of this global batch within its epoch


class ShardSampler(Sampler[int]):
    """Equal, disjoint shards of a shuffled epoch, with a fixed global batch and exact resume.

    Iterate it as a plain sampler (``DataLoader(ds, sampler=s, batch_size=s.local_batch_size)``)
    or through :meth:`batches`, which also says which entries are padding. Iterating to the
    end of an epoch moves on to the next epoch's order.

    The position advances as samples are *handed out*: with a prefetching DataLoader that is
    ahead of what was trained on, so a training loop should save the position of the batch
    it last stepped on (``Trainer`` does).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        slices: int | None = None,
    ):
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if self.num_samples < 1:
            raise ConfigError("cannot shard an empty dataset")
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
            if num_replicas is None:
                num_replicas = dist.get_world_size() if initialized else 1
            if rank is None:
                rank = dist.get_rank() if initialized else 0
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} is outside [0, num_replicas {num_replicas})")
        self.local_batch_size = local_batch_size(global_batch_size, num_replicas)
        self.global_batch_size = global_batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.slice_count = None
        if slices is not None:
            self.set_slice_count(slices)
        self.end = self.num_samples
        if drop_last:
            self.end = self.num_samples // global_batch_size * global_batch_size
            if self.end == 0:
                raise ConfigError(
                    f"drop_last with a global batch of {global_batch_size} leaves nothing of a "
                    f"{self.num_samples}-sample dataset; lower the batch size"
                )
        self.epoch = 0
        self.position = 0  # global positions of this epoch already handed out

    def set_slice_count(self, slices: int) -> None:
        """Pad the last global batch to a multiple of ``slices`` (exact mode's
        shards per step; it must divide the global batch and be a multiple of the
        world size)."""
        v = slices
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"slices must be a positive integer, got {v!r}")
        if self.global_batch_size % v or v % self.num_replicas:
            raise ConfigError(
                f"slices={v} must divide the global batch ({self.global_batch_size}) "
                f"and be a multiple of the world size ({self.num_replicas})")
        self.slice_count = v

    @property
    def _pad_multiple(self) -> int:
        return self.slice_count or self.num_replicas

    # ----------------------------------------------------------------- order
    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of sample ids, a pure function of (seed, epoch)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        # SeedSequence mixes the pair, so (seed, epoch+1) and (seed+1, epoch) differ.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch`` (optional: epochs advance by themselves)."""
        self.epoch = int(epoch)
        self.position = 0

    # ----------------------------------------------------------------- iteration
    def _chunks(self) -> list[tuple[int, int]]:
        """Global batches [start, stop) from the current position to the epoch's end."""
        starts = range(self.position, self.end, self.global_batch_size)
        return [(s, min(s + self.global_batch_size, self.end)) for s in starts]

    def num_batches(self) -> int:
        """Steps left in the current epoch (a full epoch when at its start)."""
        return len(self._chunks())

    def __len__(self) -> int:
        """Samples this rank reads in the rest of the current epoch."""
        pad = self._pad_multiple
        return sum(math.ceil((b - a) / pad) * pad // self.num_replicas
                   for a, b in self._chunks())

    def _advance(self, epoch: int, consumed_up_to: int) -> None:
        # Called *before* handing data out: a state_dict taken while the caller holds it
        # already points past it, and past the epoch's end means the next epoch.
        if consumed_up_to >= self.end:
            self.epoch, self.position = epoch + 1, 0
        else:
            self.position = consumed_up_to

    def batches(self) -> Iterator[ShardBatch]:
        """This rank's batches for the rest of the current epoch, then move to the next."""
        epoch, order = self.epoch, self.order(self.epoch)
        n, world = self.num_samples, self.num_replicas
        pad = self._pad_multiple
        for start, stop in self._chunks():
            padded_stop = start + math.ceil((stop - start) / pad) * pad
            positions = range(start + self.rank, padded_stop, world)
            batch = ShardBatch(
                indices=[int(order[q % n]) for q in positions],
                num_real=sum(1 for q in positions if q < stop),
                global_num_real=stop - start,
                epoch=epoch,
                step=start // self.global_batch_size,
            )
            self._advance(epoch, stop)
            yield batch

    def __iter__(self) -> Iterator[int]:
        """Sample by sample; the position advances per sample, so a state_dict taken
        between any two samples resumes exactly (all ranks are assumed in lockstep)."""
        epoch, order = self.epoch, self.order(self.epoch)
        n, world = self.num_samples, self.num_replicas
        pad = self._pad_multiple
        for start, stop in self._chunks():
            padded_stop = start + math.ceil((stop - start) / pad) * pad
            for k, q in enumerate(range(start + self.rank, padded_stop, world)):
                # After every rank handed out k+1 samples of this chunk, the job has
                # consumed its first (k+1) * world positions.
                self._advance(epoch, min(start + (k + 1) * world, stop))
                yield int(order[q % n])

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": self.num_replicas,  # informational: the position is global
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resume with the same data and seed"
                )
        position = int(state["position"])
        if not 0 <= position <= self.end:
            raise ConfigError(f"sampler position {position} is outside the epoch [0, {self.end}]")
        self.epoch = int(state["epoch"])
        self.position = position
        if self.position == self.end:
            self.epoch, self.position = self.epoch + 1, 0
