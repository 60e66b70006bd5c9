"""The data side of a :class:`ddpkit.Run`: the loader a loop hands to
``run.batches(loader)`` checked against the run's sampler, its worker processes made
deaf to the launcher's stop signals, exact mode's slice count shared by the engine and
the sampler, and the sample ids a step reads."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from ddpkit.data.partition import ShardSampler
from ddpkit.errors import ConfigError
from ddpkit.slice_count import check_slices, default_slices


def loader_sampler(loader: Any, sampler: ShardSampler | None,
                   signals: tuple[int, ...]) -> ShardSampler:
    """The ShardSampler ``loader`` draws from (``sampler`` when there is no loader),
    checked against the run's ``sampler``; a loader with workers gets a
    ``worker_init_fn`` that keeps them alive through ``signals``."""
    if loader is not None:
        found = getattr(loader, "sampler", None)
        if not isinstance(found, ShardSampler):
            raise ConfigError("run.batches(loader): the loader must draw from a ShardSampler "
                              "(DataLoader(dataset, sampler=sampler, batch_size="
                              "sampler.local_batch_size))")
        if sampler is not None and found is not sampler:
            raise ConfigError("run.batches(loader): the loader's sampler is not the Run's "
                              "sampler=; pass the same one")
        if getattr(loader, "batch_size", None) != found.local_batch_size:
            raise ConfigError(
                f"run.batches(loader): the loader's batch_size is "
                f"{getattr(loader, 'batch_size', None)}, the sampler's local batch is "
                f"{found.local_batch_size}; give the DataLoader batch_size="
                "sampler.local_batch_size (accumulate several batches per step instead)")
        if getattr(loader, "drop_last", False):
            raise ConfigError("run.batches(loader): use ShardSampler(drop_last=True) instead "
                              "of DataLoader(drop_last=True)")
        sampler = found
        if getattr(loader, "num_workers", 0) and not isinstance(loader.worker_init_fn,
                                                                   _QuietWorker):
            loader.worker_init_fn = _QuietWorker(loader.worker_init_fn, signals)
    if sampler is None:
        raise ConfigError("run.batches() needs a sampler: Run(..., sampler=ShardSampler(...))")
    return sampler


def share_slice_count(engine: Any, sampler: ShardSampler) -> None:
    """Exact mode: one slice count for the engine (an ExactReducer) and the sampler
    (which pads the last batch of an epoch to a multiple of it): the engine's, else the
    sampler's, else the default for the global batch."""
    v = (engine.slice_count or sampler.slice_count
         or default_slices(sampler.global_batch_size))
    if sampler.slice_count not in (None, v):
        raise ConfigError(f"Run(exact=True): the model has {v} slices, the "
                          f"sampler {sampler.slice_count}; give both the same")
    check_slices(v, sampler.global_batch_size, engine.world_size)
    engine.set_slice_count(v)
    sampler.set_slice_count(v)


class _QuietWorker:
    """A DataLoader ``worker_init_fn``: the workers ignore the stop signals from anyone
    but their own parent.

    Launchers signal the whole process group: torchrun's agent and SLURM send SIGTERM to
    the loader's worker processes as well, which then die, and the main process raises
    "DataLoader worker is killed by signal" in the middle of the step the preemption
    should have finished. Ignoring SIGTERM outright is no better: at exit the parent
    ends leftover workers with SIGTERM and waits for them. So the signals are blocked
    and one thread reads who sent each (``sigwaitinfo``): SIGTERM from the parent ends
    the worker, as torch's own handler does; the rest is dropped, and the loop stops
    the workers itself once it has checkpointed.
    """

    def __init__(self, inner: Any, signals: tuple[int, ...]):
        self.inner, self.signals = inner, tuple(signals)

    def __call__(self, worker_id: int) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        threading.Thread(target=_parent_only, args=(self.signals, os.getppid()), daemon=True,
                         name="ddpkit-loader-signals").start()
        if self.inner is not None:
            self.inner(worker_id)


def _parent_only(signals: tuple[int, ...], parent: int) -> None:
    while True:
        info = signal.sigwaitinfo(signals)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)


def real_ids(sampler: ShardSampler, epoch: int, start: int, stop: int) -> list[int]:
    """The real samples this rank reads of the global batch [start, stop) (as in
    ShardSampler: strided by rank, padding beyond ``stop`` left out)."""
    order = sampler.order(epoch)
    return [int(order[q]) for q in range(start + sampler.rank, stop, sampler.num_replicas)]
