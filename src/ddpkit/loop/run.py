"""``ddpkit.Run``: resume, preemption and hang detection for a training loop you write.

A run is one training job in one directory, across however many attempts it takes
(a crash and an elastic restart, a preemption and a requeue). Every rank enters it::

    with ddpkit.Run("runs/gpt", model=model, optimizer=opt, scheduler=sched,
                    sampler=sampler, every_steps=100) as run:
        for epoch in run.epochs(10):
            for x, y in run.batches(loader):
                ...forward, backward, optimizer.step()...
                run.step_done(loss=loss)

and gets what ``ddpkit train`` composes from the library:

* **Resume.** Entering continues from the newest good checkpoint in
  ``<dir>/checkpoints`` (:class:`~ddpkit.checkpoint.Checkpointer`): model, optimizer,
  scheduler, the data position, every rank's random streams, the step count and the
  ``state=`` objects you add. ``run.epochs`` and ``run.batches`` start where that
  checkpoint stopped, mid-epoch included, so the rest of the run is the uninterrupted
  run, bit for bit.
* **The data position is counted, not read.** A DataLoader with workers asks its
  sampler for indices ahead of the batches it hands out, so
  ``ShardSampler.state_dict()`` runs ahead of training. ``run.batches`` counts the
  batches it yielded instead: the position saved is that of the last batch the loop
  took, whatever the prefetch depth.
* **Cadence and preemption.** ``step_done`` makes one tiny all-reduce per step
  (:meth:`PreemptionGuard.check`): whether some rank got SIGTERM/SIGUSR1, and whether
  the step or time cadence is due on some rank's clock. A due checkpoint is written; a
  stop writes a ``preempted`` checkpoint, ends ``run.batches`` and ``run.epochs`` on
  every rank at the same step, and ``run.preempted`` is True after the block.
* **Hangs name the rank.** Each step (first batch to ``step_done``) and every
  collective of the run is inside a :class:`~ddpkit.fault.Watchdog` guard: a rank that
  stops arriving becomes a :class:`~ddpkit.fault.HangError` naming it, the step and the
  point it last reached.
* **Metrics.** Every ``log_every`` steps ``step_done(**values)`` averages the values
  over ranks and rank 0 appends a record to ``<dir>/metrics.jsonl`` (``log_with``: also
  csv, tensorboard). A record holds its own step's values, so a resumed run writes the
  records of the uninterrupted one.

Everything the loop decides on (stop, save, log) is agreed by all ranks, and every
collective runs on every rank: ``step_done`` must be called on every rank each step.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.checkpoint import Cadence, Checkpointer
from ddpkit.checkpoint.init_from import init_fresh_run
from ddpkit.data.partition import ShardBatch, ShardSampler
from ddpkit.errors import ConfigError
from ddpkit.fault import PreemptionGuard, ProgressBoard, Watchdog, set_collective_timeout
from ddpkit.log import get_logger
from ddpkit.loop import inject
from ddpkit.loop.loader import loader_sampler, real_ids, share_slice_count
from ddpkit.loop.metrics_log import MetricLog, check_writers, mean_over_ranks
from ddpkit.loop.rank0 import cannot_create, decide_on_rank0
from ddpkit.loop.run_checkpoints import RunCheckpoints
from ddpkit.loop.sample_ids import SampleLog
from ddpkit.parallel.exact.exact_reducer import ExactReducer
from ddpkit.runtime import lifetime
from ddpkit.runtime.process_group import DEFAULT_TIMEOUT

log = get_logger(__name__)

CHECKPOINT_DIR = "checkpoints"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class Run(RunCheckpoints):
    """One training job in ``directory``: resume, preemption, hang detection, metrics.

    Build it on every rank, then enter it (``with run:``) on every rank; entering and
    leaving are collective. Arguments:

    * ``model``, ``optimizer``, ``scheduler``: saved and restored (the model unwrapped).
    * ``sampler``: the :class:`~ddpkit.data.ShardSampler` feeding the loop; its position
      is tracked by :meth:`batches` (taken from the loader when not given).
    * ``every_steps`` / ``every_seconds``: checkpoint cadence (either, both or none: a
      checkpoint is written anyway when a signal stops the run and when the block ends).
      ``keep``: committed checkpoints kept.
    * ``state``: more things to save, ``{"ema": ema, ...}``, each with
      ``state_dict()``/``load_state_dict()``. ``state_dict()`` is called on every rank
      at each save, rank 0's result is stored: gather per-rank values in it yourself.
    * ``config``: a dataclass or JSON-able mapping of the settings that must not change
      across a resume; a checkpoint written under others is refused, naming them.
    * ``collective_timeout``: seconds a collective may wait before the missing rank is
      named (default: the process group's timeout). ``resume=False``: entering does not
      look for checkpoints (call :meth:`restore` yourself, or start over).
    * ``log_every``: write a metrics record every N steps (None: only values given to
      :meth:`log`). ``log_with``: ``("csv", "tensorboard")`` besides metrics.jsonl.
    * ``log_sample_ids``: every rank logs the ids it trained on at each step (see
      :mod:`ddpkit.loop.sample_ids`), for audits and tests.
    * ``exact``: ``model`` is ``DataParallel(..., exact=True)`` (the same bits at any
      world size, docs/exact.md): the run gives the engine and the sampler the same
      slice count (the engine's, else the sampler's, else the default for the
      global batch), and its checkpoints resume bit for bit at another world size.
    * ``init_from``: a run that does not resume starts from the model (and optimizer
      state) of this torch.distributed.checkpoint directory (docs/checkpoints.md).

    For applications built on it (``ddpkit train``): ``directory=None`` keeps
    everything in memory (no files, no checkpoints); ``checkpoints=False`` writes logs
    but no checkpoints (and catches no stop signal: nothing could keep the work);
    ``config_check(saved_config, source)`` replaces the fingerprint check with the
    caller's own rule; ``inject_faults=False`` leaves the ``DDPKIT_TEST_*`` variables
    to the caller.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        sampler: ShardSampler | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep: int | None = 3,
        state: Mapping[str, Stateful] | None = None,
        config: Any = None,
        collective_timeout: float | None = None,
        resume: bool = True,
        log_every: int | None = None,
        log_with: Iterable[str] = (),
        log_sample_ids: bool = False,
        checkpoints: bool = True,
        config_check: Callable[[Any, str], None] | None = None,
        inject_faults: bool = True,
        exact: bool = False,
        init_from: str | os.PathLike | None = None,
    ):
        if collective_timeout is not None and collective_timeout <= 0:
            raise ConfigError(f"collective_timeout must be > 0 seconds, got {collective_timeout}")
        if log_every is not None and log_every < 1:
            raise ConfigError(f"log_every must be >= 1 step, got {log_every}")
        if keep is not None and keep < 1:
            raise ConfigError(f"keep must be >= 1 (or None for all), got {keep}")
        for name, obj in (state or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"state[{name!r}] has no state_dict()/load_state_dict()")
        self.dir = Path(directory) if directory is not None else None
        self.checkpoints = checkpoints and self.dir is not None
        self.config_check = config_check
        self.inject_faults = inject_faults
        self.exact = getattr(model, "exact", None) if exact else None
        if exact and not isinstance(self.exact, ExactReducer):
            raise ConfigError("Run(exact=True) trains a DataParallel(model, exact=True); "
                              "wrap the model that way")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.sampler = sampler
        if sampler is not None:
            self._shard_sampler(sampler)
        self.state = dict(state or {})
        self.config = config
        self.init_from = init_from
        self.collective_timeout = collective_timeout
        self.keep = keep
        self.resume = resume
        self.log_every = log_every
        self.log_with = check_writers(log_with)
        self.log_sample_ids = log_sample_ids
        self.cadence = Cadence(every_steps, every_seconds)
        self.rank = dist.get_rank() if _initialized() else 0
        self.world_size = dist.get_world_size() if _initialized() else 1
        if _initialized():
            lifetime.destroy_default_group_at_exit()
        self.is_main = self.rank == 0
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))

        self.step = 0  # optimizer steps taken since the run began (all attempts)
        self.start_step = 0  # the step this attempt started from
        self.epoch = 0  # the epoch of the next sample to train on
        self.position = 0  # samples of that epoch consumed (a global count)
        self.resumed_from: Path | None = None
        self.stop_requested = False  # rank-agreed: a signal ends the run at this step
        self.preempted = False  # the block ended early on a stop signal (checkpoint saved)
        self.hooks: list[inject.StepHook] = []  # called with the step number after each step

        self.checkpointer: Checkpointer | None = None
        self.guard: PreemptionGuard = PreemptionGuard(device=self.device)
        self.watchdog: Watchdog | None = None
        self._stack: contextlib.ExitStack | None = None
        self._step_guard: contextlib.AbstractContextManager | None = None
        self._saved_step = -1
        self._metrics: MetricLog | None = None
        self._samples: SampleLog | None = None
        self._pending_ids: list[int] = []
        self._last_epoch = 0  # the epoch of the last batch handed out
        self._clock = time.perf_counter()
        self._clock_step = 0
        self._entered = 0  # blocks entered so far
        self._prepared = False
        self._restore_done = False
        self._token = ""

    # ------------------------------------------------------------------ enter / exit
    def prepare(self) -> None:
        """Collective, once: make the directory and the checkpoint store now (entering
        does it otherwise), e.g. to reach ``checkpointer`` early."""
        if self._prepared:
            return
        self._prepared = True
        self._token = self._agree_on_directory()
        if self.checkpoints:
            self.checkpointer = Checkpointer(self.dir / CHECKPOINT_DIR, keep=self.keep)

    def __enter__(self) -> Run:
        if self._stack is not None:
            raise ConfigError("this Run is entered already; blocks of one Run do not nest")
        self._entered += 1
        stack = contextlib.ExitStack()
        try:
            self.prepare()
            if _initialized():
                # Each block has its own progress keys: a watchdog does not outlive it.
                timeout = self.collective_timeout or DEFAULT_TIMEOUT.total_seconds()
                board = ProgressBoard(prefix=f"ddpkit/progress/{self._token}/{self._entered}")
                self.watchdog = Watchdog(timeout, board=board)
                stack.callback(self.watchdog.close)
            if self.collective_timeout is not None and _initialized():
                set_collective_timeout(self.collective_timeout)
                stack.callback(set_collective_timeout, DEFAULT_TIMEOUT.total_seconds())
            if self.resume and not self._restore_done:
                self._restore(quiet=True)
            init_fresh_run(self)
            on_main_thread = threading.current_thread() is threading.main_thread()
            if self.checkpointer is not None and on_main_thread:
                stack.enter_context(self.guard)
            if self.is_main and self.dir is not None:
                self._metrics = MetricLog(self.dir, self.log_with, start_step=self.step)
                stack.callback(self._metrics.close)
            if self.log_sample_ids and self.dir is not None:
                self._samples = SampleLog(self.dir, self.rank)
                stack.callback(self._samples.close)
            if self.inject_faults and self._entered == 1:
                restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
                self.hooks += inject.step_hooks(os.environ, self.rank, restarts,
                                                lambda: self.guard.requested)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self._clock, self._clock_step = time.perf_counter(), self.step
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        stack, self._stack = self._stack, None
        try:
            if self._step_guard is not None:
                step_guard, self._step_guard = self._step_guard, None
                # The exception left the user's step inside its guard: a collective
                # timeout there becomes a HangError naming the ranks behind.
                step_guard.__exit__(exc_type, exc, tb)
            if (exc_type is None and not self.preempted and self.checkpointer is not None
                    and self.step > self._saved_step):
                self.save("final")
        finally:
            if stack is not None:
                stack.close()

    @property
    def active(self) -> bool:
        """Whether the run is entered (inside its ``with`` block)."""
        return self._stack is not None

    def _agree_on_directory(self) -> str:
        """Rank 0 creates the directory; every rank learns a token naming this attempt's
        progress keys in the store, or every rank raises rank 0's error."""
        def create() -> str:
            if self.dir is not None:
                try:
                    self.dir.mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    raise cannot_create(self.dir, err) from None
            return uuid.uuid4().hex[:12]

        return str(decide_on_rank0(create, is_main=self.is_main, world_size=self.world_size))

    @contextlib.contextmanager
    def guarded(self, name: str) -> Iterator[None]:
        """The watchdog's guard around a collective section ``name`` of this step."""
        with self.watchdog.guard(self.step, name) if self.watchdog else contextlib.nullcontext():
            yield

    # ------------------------------------------------------------------ the loop
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs left to train, from the one a resume lands in; ends early when a
        stop signal ended the run."""
        while self.epoch < num_epochs and not self.stop_requested:
            epoch = self.epoch
            yield epoch
            if self.epoch == epoch and not self.stop_requested:
                # The body left the epoch before its end (a break): go on with the next.
                self.epoch, self.position = epoch + 1, 0

    def batches(self, loader: Iterable[Any] | None = None) -> Iterator[Any]:
        """The loop's batches from the current data position to the end of the epoch.

        ``loader``: a DataLoader over ``sampler`` (``batch_size=sampler.local_batch_size``);
        None iterates the sampler's own :class:`ShardBatch` es. The loader's worker
        processes are made to ignore SIGTERM/SIGUSR1 (a launcher signals them too; the
        loop stops them after its checkpoint). Ends early, on every
        rank at the same step, when a stop signal ended the run.
        """
        self.sampler = loader_sampler(loader, self.sampler, self.guard.signals)
        sampler = self._shard_sampler(self.sampler)
        sampler.load_state_dict({"epoch": self.epoch, "position": self.position})
        self.epoch, self.position = sampler.epoch, sampler.position
        epoch, start = self.epoch, self.position
        if loader is None:
            source: Iterator[Any] = sampler.batches()
        else:
            # Making an iterator draws a worker base seed from torch's global stream;
            # a resumed run makes one mid-epoch, the uninterrupted run did not. Forking
            # keeps the loop's own random stream the same in both.
            with torch.random.fork_rng(devices=[]):
                source = iter(loader)
        g, end = sampler.global_batch_size, sampler.end
        try:
            done = start
            while not self.stop_requested:
                try:
                    batch = next(source)
                except StopIteration:
                    break
                chunk = (done, min(done + g, end))
                done = chunk[1]
                if self._samples is not None:
                    self._pending_ids += real_ids(sampler, epoch, *chunk)
                self.epoch, self.position = (epoch + 1, 0) if done >= end else (epoch, done)
                self._last_epoch = epoch
                self._open_step_guard()
                yield batch
        finally:
            close = getattr(source, "close", None)  # a generator; a DataLoader's iterator
            if close is not None:                   # stops its workers when dropped
                close()
            del source

    def _shard_sampler(self, sampler: ShardSampler) -> ShardSampler:
        if self.exact is not None:  # one slice count for the engine and the sampler
            share_slice_count(self.exact, sampler)
        return sampler

    def _open_step_guard(self) -> None:
        if self.watchdog is not None and self._step_guard is None:
            self._step_guard = self.watchdog.guard(self.step + 1, "train_step")
            self._step_guard.__enter__()

    def _close_step_guard(self) -> None:
        if self._step_guard is not None:
            step_guard, self._step_guard = self._step_guard, None
            step_guard.__exit__(None, None, None)

    def step_done(self, *, save: bool = True, **values: float | torch.Tensor) -> bool:
        """Collective: one optimizer step is done. Returns True when the run must stop.

        Counts the step, writes the sample-id line, every ``log_every`` steps writes a
        metrics record with the mean over ranks of ``values`` (floats or 0-dim tensors,
        the same names on every rank; other steps leave them untouched), and agrees with
        the other ranks on stop/save: a due checkpoint is written here; on a stop, the
        ``preempted`` one, and :meth:`batches`/:meth:`epochs` end. ``save=False``: agree,
        but write nothing (the caller saves, e.g. after an epoch's evaluation).
        """
        if self._stack is None:
            raise ConfigError("run.step_done() outside the run: enter it first (`with run:`)")
        self._close_step_guard()
        self.step += 1
        if self._samples is not None:
            with self.guarded("sample_ids"):
                self._samples.write_agreed(self.step, self._last_epoch, self._pending_ids,
                                           self.world_size, self.device)
            self._pending_ids = []
        for hook in self.hooks:
            hook(self.step)
        if self.log_every and self.step % self.log_every == 0:
            self.log(**values)
        return self.check(save=save)

    def check(self, *, save: bool = True) -> bool:
        """Collective: agree on stop/save at this step (``step_done`` calls it); with
        ``save=False`` nothing is written and the caller saves. True: stop now.
        A run that keeps no checkpoints has nothing to agree on: False, no collective."""
        if self.checkpointer is None:
            return False
        with self.guarded("step_check"):
            stop, due = self.guard.check(self.step, save_due=self.cadence.due(self.step))
        if stop and not self.stop_requested:
            self.stop_requested = True
            if save:
                self.save("preempted")
                self.preempted = True
        elif due and save:
            self.save("periodic")
        return stop

    # ------------------------------------------------------------------ metrics
    def log(self, **values: Any) -> dict[str, Any]:
        """Collective: write a metrics record of the current step now (rank 0 writes it).

        Holds ``step``, ``epoch`` (1-based, that of the last batch), the learning rate,
        steps per second since the last record, every rank's peak RSS in MiB
        (``rank_peak_rss_mib``), the mean over ranks of each of ``values`` (floats or
        0-dim tensors, the same names on every rank). Returns the
        record on every rank.
        """
        out: dict[str, Any] = {"step": self.step, "epoch": self._last_epoch + 1}
        if self.optimizer is not None:
            out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        with self.guarded("metrics"):  # one collective
            out.update(mean_over_ranks(values, self.rank, self.world_size, self.device))
        now = time.perf_counter()
        if self.step > self._clock_step and now > self._clock:
            out["steps_per_s"] = (self.step - self._clock_step) / (now - self._clock)
        self._clock, self._clock_step = now, self.step
        if self._metrics is not None:
            self._metrics.write(out)
        return out

    def write_record(self, record: Mapping[str, Any]) -> None:
        """Rank 0 appends ``record`` as it is (it has a ``step``; every rank agreed on
        it already, e.g. an epoch's reduced metrics) to metrics.jsonl; not a collective.
        A resume cuts it with the records of later steps."""
        if self._metrics is not None:
            self._metrics.write(record, jsonl_only=True)


# ShardBatch is what batches() yields without a loader; exported for type hints.
__all__ = ["CHECKPOINT_DIR", "Run", "ShardBatch", "Stateful"]
