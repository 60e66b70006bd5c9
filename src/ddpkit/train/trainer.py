"""The training loop: the synchronous SGD of PyTorch's distributed tutorial, with the parts
a real run needs.

Each epoch every rank trains on its shard of the global batches (ShardSampler), the
engine averages gradients, then every rank evaluates its shard of the test set and the
metric sums are reduced (see metrics.py). Rank 0 alone draws the progress bar and writes
the run directory: ``config.json``, ``metrics.jsonl`` (one record per epoch, through the
run's metrics log), ``train.log``, ``summary.json`` and ``curves.png`` (run_outputs.py).
The data, model, engine and optimizer come from :func:`ddpkit.train.build.build_parts`.

The loss that drives backward is the sum over this rank's *real* samples scaled by
``world_size / real samples in the global batch``: after the engine averages over ranks
the gradient is exactly that of the mean loss over the global batch, also for a padded
last batch, so W processes take the same steps as one process would.

Where the loop is (step, epoch, data position) and the metrics log are the
:class:`ddpkit.Run`'s, which every step reports to; the trainer adds the records of
the epochs it finished (:class:`EpochHistory`) to the run's checkpointed state, and
``step_callbacks`` run after every step.

Fault tolerance (docs/checkpoints.md) is :class:`ddpkit.Run`'s, the object a user's own
loop enters too (docs/own-loop.md); all of it at step boundaries, where every rank is at
the same point:

* after each step one tiny all-reduce (:meth:`PreemptionGuard.check`) agrees on "stop"
  (a SIGTERM/SIGUSR1 reached some rank) and "save" (the step or time cadence is due on
  some rank's clock); a checkpoint is written at every epoch's end as well;
* :meth:`Trainer.restore` continues from the newest good checkpoint of the run
  directory: model, optimizer, sampler position, per-rank RNG streams and the epoch's
  partial metric sums, so the rest of the run is the uninterrupted run, bit for bit;
* each collective runs inside a :class:`Watchdog` guard, so a rank that stops arriving
  turns into a :class:`HangError` naming it, the step and the collective;
* a loss or weights that stop being finite end the run before anything is saved from
  them (:mod:`ddpkit.train.divergence`), and a full disk ends it with one
  :class:`~ddpkit.files.durable.DiskFullError`; the final weights are on disk before the
  summary says the run is done.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ddpkit.checkpoint import Checkpointer, CheckpointError
from ddpkit.checkpoint.model_state import unwrap
from ddpkit.data.datasets import ArrayDataset
from ddpkit.data.partition import ShardBatch
from ddpkit.errors import ConfigError
from ddpkit.fault import PreemptionGuard, Watchdog
from ddpkit.files.durable import DiskFullError, is_disk_full
from ddpkit.files.run_lock import RunLock
from ddpkit.log import get_logger
from ddpkit.loop import Run
from ddpkit.runtime.world import World
from ddpkit.train import progress, recipe, report, run_outputs
from ddpkit.train.build import Wrap, build_parts
from ddpkit.train.config import Config
from ddpkit.train.epoch_state import EpochHistory, EpochSums, refuse_non_finite_record
from ddpkit.train.metrics import MetricSums, gather_floats
from ddpkit.train.resume import refuse_changed_config
from ddpkit.train.run_plan import RunPlan

log = get_logger(__name__)

def slice_step(model, slices, scale: float,
               precision: recipe.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact mode's step (docs/exact.md) over ``slices``, ``(inputs, labels, real mask)``
    triples from ``model.slices`` (or the one-process reference's): each slice's loss is
    its real samples' sum times ``scale`` (``V / real samples in the global batch``); the
    engine averages over the V slices, so the gradient is the mean over the global
    batch, as in the default mode. Returns the real samples' losses and hits."""
    all_losses, all_correct = [], []
    for xs, ys, real_s in slices:
        # A slice's real samples come first (the padding is at the batch's end).
        n = int(real_s.sum())
        with precision.autocast():
            out = model(xs)
        losses = F.nll_loss(precision.full(out), ys, reduction="none")[:n]
        precision.backward(losses.sum() * scale)
        all_losses.append(losses.detach())
        all_correct.append(out[:n].argmax(dim=1) == ys[:n])
    return torch.cat(all_losses), torch.cat(all_correct)


class Trainer:
    """Build data, model, engine and optimizer from a :class:`Config`; ``fit()`` trains.

    ``run_dir``: where rank 0 writes results; None makes a new one under
    ``cfg.train.out_dir`` (rank 0 creates it, the others learn its name). Pass
    ``write=False`` to keep everything in memory (tests, verify): no files, no
    checkpoints, no signal handling.

    Checkpoints go to ``<run_dir>/checkpoints`` (``cfg.checkpoint``); call
    :meth:`restore` before :meth:`fit` to continue from the newest one. After ``fit``,
    ``preempted`` says whether a stop signal ended the run early (a checkpoint holds
    its position).
    """

    def __init__(
        self,
        cfg: Config,
        world: World,
        *,
        run_dir: str | os.PathLike | None = None,
        datasets: tuple[ArrayDataset, ArrayDataset] | None = None,
        wrap: Wrap | None = None,
        write: bool = True,
    ):
        self.cfg, self.world = cfg, world
        self.parts = parts = build_parts(cfg, world, datasets=datasets, wrap=wrap)
        self.device = parts.device
        self.train_set, self.test_set = parts.train_set, parts.test_set
        self.model, self.engine, self.sharded = parts.model, parts.engine, parts.sharded
        self.optimizer, self.precision = parts.optimizer, parts.precision
        self.sampler, self.test_sampler = parts.sampler, parts.test_sampler
        self.total_steps = parts.total_steps
        self.rank_peak_rss_mib: list[float] = []  # every rank's, as of the last epoch
        self.history = EpochHistory()
        self.step_callbacks: list[Callable[[Trainer], None]] = []
        self.write = write
        self.epoch_sums = EpochSums(self)  # checkpointed with the run; holds resumed sums
        self.run_lock: RunLock | None = None  # rank 0's hold on the run directory
        # (time, step) the progress ETA is measured from: set by the first bar
        self.progress_clock: tuple[float, int] | None = None
        run_dir = run_outputs.agree_on_run(self, RunPlan(Path(run_dir) if run_dir else None))
        self.run_dir = Path(run_dir) if write else None

        t, c = cfg.train, cfg.checkpoint
        # The run owns checkpoints, the data position, per-rank RNG, the stop agreement,
        # the watchdog and the logs; the trainer adds its epoch records and sums to it.
        self.run = Run(
            self.run_dir, model=self.model, optimizer=self.optimizer, sampler=self.sampler,
            every_steps=c.every_steps, every_seconds=c.every_seconds, keep=c.keep,
            state={"loop": self.history, "precision": self.precision,
                   "epoch_sums": self.epoch_sums},
            config=cfg.identity(), config_check=self._refuse_changed_config,
            collective_timeout=cfg.fault.collective_timeout, resume=False,
            log_sample_ids=t.log_sample_ids, checkpoints=c.enabled, inject_faults=False,
            log_every=t.log_every_steps or None, log_with=t.log_with.split(","),
            exact=t.exact, init_from=c.init_from,
        )
        self.run.hooks.append(self._step_callbacks)
        self.run.prepare()  # collective: an unwritable checkpoint directory fails here
        self.preempted = False  # set when a stop signal ended fit() early
        # Running metric sums of the epoch in progress (checkpointed mid-epoch).
        self._sums: MetricSums | None = None

    # The run's pieces under the names this class always had.
    @property
    def checkpointer(self) -> Checkpointer | None:
        return self.run.checkpointer

    @property
    def preemption(self) -> PreemptionGuard:
        return self.run.guard

    @property
    def watchdog(self) -> Watchdog | None:
        return self.run.watchdog

    def _step_callbacks(self, step: int) -> None:
        for callback in self.step_callbacks:
            callback(self)

    def _refuse_changed_config(self, saved: Any, source: str) -> None:
        if saved is None:
            raise CheckpointError(f"{source} was not written by ddpkit train; cannot resume it")
        refuse_changed_config(saved, self.cfg, source)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in unwrap(self.model).parameters())

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, reason: str = "periodic") -> Path:
        """Collective: write the job's state as a checkpoint of the current step."""
        if self.checkpointer is None:
            raise ConfigError("checkpoints are disabled for this trainer (--no-checkpoints)")
        return self.run.save(reason)

    def restore(self, *, required: bool = False) -> dict[str, Any] | None:
        """Collective: continue from the newest good checkpoint of the run directory.

        Returns what :func:`ddpkit.checkpoint.restore_state` reports, or None when there
        is nothing to resume (an error instead with ``required=True``). A checkpoint
        written under other model, optimizer or data settings is refused, naming them.
        At another world size the data position and optimizer are restored exactly and
        per-rank random streams start fresh (one warning).
        """
        if self.checkpointer is None:
            if required or not self.write:
                raise ConfigError("cannot resume with checkpoints disabled (--no-checkpoints)")
            log.warning("checkpoints are disabled (--no-checkpoints): starting from step 0")
            self.run.sync_logs()
            return None
        return self.run.restore(required=required)

    # ------------------------------------------------------------------ steps
    def train_epoch(self, epoch: int | None = None) -> dict[str, Any]:
        """Train ``epoch`` (default: the one the run is in) from the run's data position
        to its end, or to an agreed stop; returns the epoch's train metrics."""
        if not self.run.active:  # called on its own, outside fit(): a block of its own
            with self.run:
                return self.train_epoch(epoch)
        self.model.train()
        run = self.run
        epoch = run.epoch if epoch is None else epoch
        # A state saved right after an epoch's last step has the data position already in
        # the next epoch: that epoch's training is done, only evaluation is left. The run
        # counts the position and ends the batches on every rank when a signal stops it.
        batches = run.batches() if run.epoch == epoch else iter(())
        # Resumed mid-epoch: the sums continue where the checkpoint left them.
        sums = self.epoch_sums.take_resumed() or MetricSums(self.device)
        self._sums = sums
        total = len(self.train_set) if run.position == 0 else None
        bar = self._progress(epoch, total)
        start = time.perf_counter()
        seen = 0
        every = self.cfg.train.log_every_steps
        for group in recipe.accumulation_groups(batches, self.cfg.train.grad_accum):
            record = every and (run.step + 1) % every == 0  # a per-step record
            before = sums.local() if record else None
            self.train_step(group, sums)  # inside the run's 'train_step' watchdog guard
            num_real = sum(b.global_num_real for b in group)
            seen += num_real
            if bar is not None:
                bar.update(num_real)
            # Sample ids, step_callbacks, then the stop/save agreement. At an epoch's last
            # step nothing is written there: the epoch-end checkpoint follows right after
            # evaluation and carries the epoch's record, so a stop requested there waits.
            values = {}
            if before is not None:  # this rank's mean loss over the step's real samples
                after = sums.local()
                values["train_loss"] = ((after.loss_sum - before.loss_sum)
                                        / max(after.count - before.count, 1))
            run.step_done(save=run.epoch == epoch, **values)  # the run counts the step
        seconds = time.perf_counter() - start
        if bar is not None:
            bar.close()
        if run.preempted:  # every rank stopped at this step; the epoch is not over
            self.preempted = True
            return {}
        with self.run.guarded("train_metrics"):
            totals = sums.reduce()
            mine = sums.local()
            rank_loss = gather_floats(mine.loss, self.device)
            rank_samples = [int(v) for v in gather_floats(mine.count, self.device)]
            self.rank_peak_rss_mib = gather_floats(progress.peak_rss_mib(), self.device)
        self._sums = None
        return {
            "train_loss": totals.loss,
            "train_acc": totals.accuracy,
            "train_samples": int(totals.count),
            "rank_train_loss": rank_loss,
            "rank_train_samples": rank_samples,
            "rank_peak_rss_mib": self.rank_peak_rss_mib,
            "train_time_s": seconds,
            "samples_per_s": seen / seconds if seconds > 0 else float("nan"),
        }

    def train_step(self, group: ShardBatch | list[ShardBatch], sums: MetricSums) -> None:
        """One optimizer step over ``group``'s batches (several with --grad-accum)."""
        group = group if isinstance(group, list) else [group]
        o = self.cfg.optim
        self.optimizer.zero_grad(set_to_none=True)
        recipe.set_lr(self.optimizer, recipe.lr_at(self.run.step, o.lr, o.lr_schedule,
                                                   o.warmup_steps, self.total_steps))
        if self.cfg.train.exact:
            self._exact_step(group[0], sums)
            self.precision.step(self.optimizer, unwrap(self.model).parameters(),
                                o.clip_grad_norm)
            return
        # The step's loss is the mean over every real sample of its global batches.
        scale = self.world.world_size / sum(b.global_num_real for b in group)
        for i, batch in enumerate(group):
            x, y = self.train_set.batch(batch.indices)
            # Every rank runs forward/backward on its whole batch, padding included, so the
            # engine's collectives line up; only real samples carry loss.
            with recipe.no_sync(self.model, last=i == len(group) - 1):
                with self.precision.autocast():
                    out = self.model(x)
                losses = F.nll_loss(self.precision.full(out), y, reduction="none")[: batch.num_real]
                self.precision.backward(losses.sum() * scale)
            correct = out[: batch.num_real].argmax(dim=1) == y[: batch.num_real]
            sums.add(losses.detach(), correct)
        self.precision.step(self.optimizer, unwrap(self.model).parameters(), o.clip_grad_norm,
                            clip_with=self.model.clip_grad_norm_ if self.sharded else None)

    def _exact_step(self, batch: ShardBatch, sums: MetricSums) -> None:
        """Exact mode: the batch's forward/backward slice by slice (:func:`slice_step`)."""
        x, y = self.train_set.batch(batch.indices)
        real = torch.arange(len(batch.indices), device=self.device) < batch.num_real
        sums.add(*slice_step(self.model, self.model.slices(x, y, real),
                             self.parts.slices / batch.global_num_real, self.precision))

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Test loss/accuracy over the whole test set, padding excluded (a collective)."""
        if self.sharded:  # every rank's updated shards into the module (collective)
            self.model.gather_parameters()
        model = unwrap(self.model)  # weights are in sync: no engine, no collectives
        model.eval()
        sums = MetricSums(self.device)
        self.test_sampler.set_epoch(0)
        for batch in self.test_sampler.batches():
            x, y = self.test_set.batch(batch.indices[: batch.num_real])
            with self.precision.autocast():
                out = model(x)
            sums.add(F.nll_loss(self.precision.full(out), y, reduction="none"),
                     out.argmax(dim=1) == y)
        with self.run.guarded("test_metrics"):
            totals = sums.reduce()
        model.train()
        return {"test_loss": totals.loss, "test_acc": totals.accuracy,
                "test_samples": int(totals.count)}

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        """Train to the last epoch (or to an agreed stop); returns the summary."""
        try:
            return self._fit()
        except (DiskFullError, OSError) as err:
            if not is_disk_full(err):
                raise
            raise run_outputs.disk_full(self, err) from None
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _fit(self) -> dict[str, Any]:
        t = self.cfg.train
        started = time.perf_counter()
        run_outputs.main_writes(self, lambda: report.write_json(
            self.run_dir / report.CONFIG_FILE,
            {**self.cfg.to_dict(), "world_size": self.world.world_size}))
        if self.write and self.world.is_main:
            log.info(f"run directory: {self.run_dir}")
            log.info(
                f"{self.cfg.data.name} ({len(self.train_set)} train / {len(self.test_set)} test), "
                f"model {self.cfg.model.name} ({self.num_parameters:,} parameters), "
                f"{self.world.world_size} rank(s) x {self.sampler.local_batch_size} = global batch "
                f"{t.batch_size}, engine {self.engine}"
            )
        with self.run:  # signal handlers, the collective timeout, the watchdog, logs
            while self.history.epochs < t.epochs:
                record = {"epoch": self.history.epochs + 1}
                record.update(self.train_epoch(self.history.epochs))
                if self.preempted:
                    break
                record.update(self.evaluate())
                refuse_non_finite_record(self, record)
                record["step"] = self.run.step
                record["time_s"] = time.perf_counter() - started
                self.history.records.append(record)
                self._report_epoch(record)
                if self.checkpointer is not None:
                    stop = self.preemption.stopped_by is not None
                    last = self.history.epochs == t.epochs
                    self.save_checkpoint("preempted" if stop else "final" if last else "epoch")
                    if stop:
                        self.preempted = True
                        break
        summary = run_outputs.summary(self, time.perf_counter() - started)
        if self.preempted:
            summary["preempted"] = True
            if self.write:
                log.warning(f"stopped by a signal at step {self.run.step}; checkpoint saved; "
                            f"resume with: ddpkit train --resume {self.run_dir}")
            return summary
        run_outputs.main_writes(self, lambda: run_outputs.write_results(self, summary))
        if self.write and self.world.is_main:
            log.info(
                f"done: test accuracy {100 * summary['final_test_acc']:.2f}% "
                f"(best {100 * summary['best_test_acc']:.2f}%) after {summary['epochs']} epochs, "
                f"{summary['train_time_s']:.1f} s; results in {self.run_dir}"
            )
        return summary

    def _report_epoch(self, record: dict[str, Any]) -> None:
        run_outputs.main_writes(self, lambda: self.run.write_record(record))
        epochs = self.cfg.train.epochs
        run_outputs.main_writes(
            self, lambda: progress.append_epoch_log(self.run_dir, record, epochs))
        log.info(progress.epoch_line(record, epochs))

    def _progress(self, epoch: int, total: int | None):
        if not (self.cfg.train.progress and self.world.is_main and self.write):
            return None
        # To the launcher's progress file under ddpkit train/launch, else a tqdm bar.
        return progress.open_bar(self, epoch, total)


