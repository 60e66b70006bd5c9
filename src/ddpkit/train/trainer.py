"""The training loop: the synchronous SGD of PyTorch's distributed tutorial, with the parts
a real run needs.

Each epoch every rank trains on its shard of the global batches (ShardSampler), the
engine averages gradients, then every rank evaluates its shard of the test set and the
metric sums are reduced (see metrics.py). Rank 0 alone draws the progress bar and writes
the run directory: ``config.json``, ``metrics.jsonl`` (one record per epoch), ``train.log``,
``summary.json`` and ``curves.png``.

The loss that drives backward is the sum over this rank's *real* samples scaled by
``world_size / real samples in the global batch``: after the engine averages over ranks
the gradient is exactly that of the mean loss over the global batch, also for a padded
last batch, so W processes take the same steps as one process would.

Everything needed to continue the loop lives in :class:`LoopState` (epoch, step,
sampler position, history); :meth:`Trainer.state_dict` adds the model and optimizer.
That is the seam for checkpoint/resume, and ``step_callbacks`` run after every step.

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
  :class:`~ddpkit.durable.DiskFullError`; the final weights are on disk before the
  summary says the run is done.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.checkpoint import Checkpointer, CheckpointError
from ddpkit.checkpoint.model_state import unwrap
from ddpkit.data.datasets import ArrayDataset
from ddpkit.data.partition import ShardBatch, ShardSampler
from ddpkit.durable import DiskFullError, free_bytes, is_disk_full
from ddpkit.errors import ConfigError
from ddpkit.fault import PreemptionGuard, Watchdog
from ddpkit.log import get_logger
from ddpkit.loop import Run
from ddpkit.loop.rank0 import cannot_create, decide_on_rank0
from ddpkit.parallel import data_parallel
from ddpkit.parallel.zero.sharded_state import state_bytes
from ddpkit.run_lock import RunLock, held_for_us
from ddpkit.slice_count import EXACT_THREADS
from ddpkit.train import divergence, progress, recipe, report
from ddpkit.train.config import Config
from ddpkit.train.metrics import MetricSums, gather_floats
from ddpkit.train.resume import refuse_changed_config
from ddpkit.world import World

log = get_logger(__name__)

Wrap = Callable[[nn.Module, str, torch.device], nn.Module]


@dataclass
class LoopState:
    """Where the loop is: everything besides model and optimizer a resume needs."""

    epoch: int = 0  # the epoch in progress, or the next one to start
    step: int = 0  # optimizer steps taken since the run began
    sampler: dict[str, Any] = field(default_factory=dict)  # position after the last step
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per finished epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "sampler": dict(self.sampler),
                "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.sampler = dict(state["sampler"])
        self.history = list(state["history"])


def default_threads(world: World) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # Ranks on one host share its cores; oversubscribing them makes everyone slower.
    return max(1, (cores or 1) // world.local_world_size)


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
        t = cfg.train
        # Exact mode: the same intra-op threads at every layout (the engine pins them).
        threads = t.threads or (EXACT_THREADS if t.exact else default_threads(world))
        torch.set_num_threads(threads)
        self.device = torch.device(world.device)
        train_set, test_set = datasets or recipe.load_data(cfg.data)
        self.train_set = _to_device(train_set, self.device)
        self.test_set = _to_device(test_set, self.device)

        torch.manual_seed(t.seed)  # same initial weights on every rank (and vs. 1 process)
        module = recipe.build_model(cfg.model, train_set.input_shape,
                                    train_set.num_classes).to(self.device)
        # The model is already on self.device and so are the batches, so neither engine
        # needs device_ids (torch DDP infers a single-device module's device).
        exact = {"exact": True, "slices": cfg.slice_count()} if t.exact else {}
        self.model = (wrap(module, t.engine, self.device) if wrap is not None
                      else data_parallel(module, engine=t.engine, comm=t.comm, **exact,
                                         **({} if t.shard == "none" else {"shard": t.shard})))
        torch.set_num_threads(threads)  # what the run asked for, also in exact mode
        # What actually runs: a custom ``wrap`` may not use the engine requested.
        self.engine = "torch" if type(self.model).__module__.startswith("torch.") else t.engine
        # Dropout masks should differ between ranks but still follow from the seed. (In
        # exact mode they follow the slice; nothing random is left per rank.)
        torch.manual_seed(t.seed + 1 + (0 if t.exact else world.rank))
        # Sharded: the optimizer holds this rank's pieces of the weights (and their state).
        self.sharded = getattr(self.model, "shard", "none") != "none"
        self.optimizer = recipe.build_optimizer(
            (self.model if self.sharded else unwrap(self.model)).parameters(), cfg.optim)
        self.rank_peak_rss_mib: list[float] = []  # every rank's, as of the last epoch
        self.precision = recipe.Precision(t.precision, self.device)
        self.total_steps = t.epochs * recipe.steps_per_epoch(
            len(train_set), t.batch_size, t.grad_accum, cfg.data.drop_last)
        self.sampler = ShardSampler(train_set, global_batch_size=t.batch_size,
                                    num_replicas=world.world_size, rank=world.rank,
                                    seed=t.seed, drop_last=cfg.data.drop_last,
                                    slices=cfg.slice_count())
        eval_batch = math.ceil(t.eval_batch_size / world.world_size) * world.world_size
        self.test_sampler = ShardSampler(test_set, global_batch_size=eval_batch,
                                         num_replicas=world.world_size, rank=world.rank,
                                         shuffle=False)
        self.loop = LoopState(sampler=self.sampler.state_dict())
        self.step_callbacks: list[Callable[[Trainer], None]] = []
        self.write = write
        self._lock: RunLock | None = None  # rank 0's hold on the run directory
        run_dir = self._agree_on_run(run_dir)
        self.run_dir = Path(run_dir) if write else None

        c = cfg.checkpoint
        # The run owns checkpoints, the data position, per-rank RNG, the stop agreement,
        # the watchdog and the sample-id log; the trainer adds its loop state to it.
        self.run = Run(
            self.run_dir, model=self.model, optimizer=self.optimizer, sampler=self.sampler,
            every_steps=c.every_steps, every_seconds=c.every_seconds, keep=c.keep,
            state={"loop": self.loop, "precision": self.precision,
                   "epoch_sums": _EpochSums(self)},
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
        self._resumed_sums: MetricSums | None = None

    # ------------------------------------------------------------------ setup
    def _agree_on_run(self, run_dir: str | os.PathLike | None) -> str | None:
        """Rank 0 creates the run directory (unless ``write=False``) and holds it; every
        rank learns its name, or every rank raises rank 0's error (none is left waiting)."""
        def create() -> str | None:
            if not self.write:
                return None
            try:
                if run_dir is not None:
                    Path(run_dir).mkdir(parents=True, exist_ok=True)
                    chosen = str(run_dir)
                else:
                    tag = (f"{recipe.short_name(self.cfg.data.name)}-"
                           f"{recipe.short_name(self.cfg.model.name)}-w{self.world.world_size}")
                    chosen = str(report.new_run_dir(self.cfg.train.out_dir, tag))
                if not held_for_us(chosen):  # no ddpkit launcher holds it for us
                    self._lock = RunLock.acquire(chosen)
            except OSError as err:
                where = run_dir if run_dir is not None else self.cfg.train.out_dir
                raise cannot_create(where, err) from None
            return chosen

        return decide_on_rank0(create, is_main=self.world.is_main,
                               world_size=self.world.world_size)

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

    # ------------------------------------------------------------------ state (resume seam)
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (in memory): model, optimizer, loop, epoch's metric sums."""
        self.loop.sampler = self.sampler.state_dict()
        return {"model": unwrap(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "precision": self.precision.state_dict(),
                "loop": self.loop.state_dict(),
                "epoch_sums": self._sums.values() if self._sums else [0.0, 0.0, 0.0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.load_state_dict(state.get("precision"))
        self.loop.load_state_dict(state["loop"])
        self.sampler.load_state_dict(self.loop.sampler)
        run = self.run  # the run counts steps and data from here
        run.step = run.start_step = self.loop.step
        run.epoch, run.position = self.sampler.epoch, self.sampler.position
        if "epoch_sums" in state:
            self._resumed_sums = MetricSums.from_values(state["epoch_sums"], self.device)

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
    def train_epoch(self) -> dict[str, Any]:
        """Train the epoch in progress (to its end, or to an agreed stop)."""
        if not self.run.active:  # called on its own, outside fit(): a block of its own
            with self.run:
                return self.train_epoch()
        self.model.train()
        epoch, run = self.loop.epoch, self.run
        if run.epoch < epoch:
            run.epoch, run.position = epoch, 0
        # A state saved right after an epoch's last step has the data position already in
        # the next epoch: that epoch's training is done, only evaluation is left. The run
        # counts the position and ends the batches on every rank when a signal stops it.
        batches = run.batches() if run.epoch == epoch else iter(())
        # Resumed mid-epoch: the sums continue where the checkpoint left them.
        sums = self._resumed_sums or MetricSums(self.device)
        self._sums, self._resumed_sums = sums, None
        total = len(self.train_set) if run.position == 0 else None
        bar = self._progress(epoch, total)
        start = time.perf_counter()
        seen = 0
        every = self.cfg.train.log_every_steps
        for group in recipe.accumulation_groups(batches, self.cfg.train.grad_accum):
            record = every and (self.loop.step + 1) % every == 0  # a per-step record
            before = sums.local() if record else None
            self.train_step(group, sums)  # inside the run's 'train_step' watchdog guard
            self.loop.step += 1
            self.loop.sampler = self.sampler.state_dict()
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
            run.step_done(save=run.epoch == epoch, **values)
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
        recipe.set_lr(self.optimizer, recipe.lr_at(self.loop.step, o.lr, o.lr_schedule,
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
        """Exact mode: the batch's forward/backward slice by slice (docs/exact.md).
        Each slice's loss is its real samples' sum times ``V / real samples in the
        global batch``; the engine averages over the V slices, so the gradient is the
        mean over the global batch, as in the default mode."""
        x, y = self.train_set.batch(batch.indices)
        real = torch.arange(len(batch.indices), device=self.device) < batch.num_real
        scale = self.cfg.slice_count() / batch.global_num_real
        all_losses, all_correct = [], []
        for xs, ys, real_s in self.model.slices(x, y, real):
            # A slice's real samples come first (the padding is at the batch's end).
            n = int(real_s.sum())
            with self.precision.autocast():
                out = self.model(xs)
            losses = F.nll_loss(self.precision.full(out), ys, reduction="none")[:n]
            self.precision.backward(losses.sum() * scale)
            all_losses.append(losses.detach())
            all_correct.append(out[:n].argmax(dim=1) == ys[:n])
        sums.add(torch.cat(all_losses), torch.cat(all_correct))

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
            raise self._disk_full(err) from None
        finally:
            if self._lock is not None:
                self._lock.release()

    def _disk_full(self, err: BaseException) -> DiskFullError:
        """``err`` as a DiskFullError that says how to go on from here."""
        if not isinstance(err, DiskFullError):  # a raw ENOSPC from a log append
            where = Path(getattr(err, "filename", None) or self.run_dir or ".")
            err = DiskFullError(where, None, free_bytes(where))
        if self.checkpointer is not None and self.write:
            return err.with_advice(f"free some space there, then continue the run: "
                                   f"ddpkit train --resume {self.run_dir}")
        return err.with_advice("free some space there and start the run again")

    def _fit(self) -> dict[str, Any]:
        t = self.cfg.train
        started = time.perf_counter()
        self._main_writes(lambda: report.write_json(
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
            while self.loop.epoch < t.epochs:
                record = {"epoch": self.loop.epoch + 1}
                record.update(self.train_epoch())
                if self.preempted:
                    break
                record.update(self.evaluate())
                self._refuse_non_finite(record)
                record["step"] = self.loop.step
                record["time_s"] = time.perf_counter() - started
                self.loop.history.append(record)
                self.loop.epoch += 1
                self._report_epoch(record)
                if self.checkpointer is not None:
                    stop = self.preemption.stopped_by is not None
                    last = self.loop.epoch == t.epochs
                    self.save_checkpoint("preempted" if stop else "final" if last else "epoch")
                    if stop:
                        self.preempted = True
                        break
        summary = self._summary(time.perf_counter() - started)
        if self.preempted:
            summary["preempted"] = True
            if self.write:
                log.warning(f"stopped by a signal at step {self.loop.step}; checkpoint saved; "
                            f"resume with: ddpkit train --resume {self.run_dir}")
            return summary
        self._main_writes(lambda: self._write_results(summary))
        if self.write and self.world.is_main:
            log.info(
                f"done: test accuracy {100 * summary['final_test_acc']:.2f}% "
                f"(best {100 * summary['best_test_acc']:.2f}%) after {summary['epochs']} epochs, "
                f"{summary['train_time_s']:.1f} s; results in {self.run_dir}"
            )
        return summary

    def _write_results(self, summary: dict[str, Any]) -> None:
        # The weights first: a summary says the run is done, so it comes only once they
        # are safely on disk.
        report.save_model(unwrap(self.model).state_dict(), self.run_dir / report.MODEL_FILE)
        report.write_json(self.run_dir / report.SUMMARY_FILE, summary)
        report.plot_curves(self.loop.history, self.run_dir / report.PLOT_FILE,
                           title=f"{self.cfg.data.name} / {self.cfg.model.name}, "
                                 f"{self.world.world_size} ranks")

    def _main_writes(self, write: Callable[[], None]) -> None:
        """Rank 0 runs ``write`` (files of the run directory); every rank learns how it
        went, so that a full disk there ends every rank with the same error rather than
        leaving the others to find rank 0 gone in their next collective."""
        if not self.write:
            return
        failure: BaseException | None = None
        if self.world.is_main:
            try:
                write()
            except Exception as err:
                failure = self._disk_full(err) if is_disk_full(err) else err
        if dist.is_initialized() and self.world.world_size > 1:
            told = [failure if isinstance(failure, DiskFullError) or failure is None else
                    CheckpointError(f"rank 0 failed writing to {self.run_dir} "
                                    f"({type(failure).__name__}: {failure}); see its error")]
            dist.broadcast_object_list(told, src=0)
            if failure is None and told[0] is not None:
                raise told[0]
        if failure is not None:
            raise failure

    def _refuse_non_finite(self, record: dict[str, Any]) -> None:
        """End the run at an epoch's end whose reduced loss is not finite (every rank sees
        the same reduced numbers, so every rank stops here)."""
        for split in ("train", "test"):
            loss = record.get(f"{split}_loss")
            if record.get(f"{split}_samples") and divergence.first_bad([loss]) is not None:
                raise self._diverged(f"the {split} loss is {loss}")

    def refuse_non_finite_state(self, rank_sums: list[list[float]]) -> None:
        """Before a checkpoint: every rank's running sums of this epoch (``rank_sums``,
        the same list on every rank) and the weights (equal on every rank) must be finite,
        or the run ends without writing it."""
        for rank, sums in enumerate(rank_sums):
            bad = divergence.first_bad(sums[:1])
            if bad is not None:
                raise self._diverged(f"the training loss on rank {rank} is {bad}")
        if self.sharded:  # every rank's updated shards into the module (collective)
            self.model.gather_parameters()
        if not divergence.weights_finite(unwrap(self.model).parameters()):
            raise self._diverged("the weights are no longer finite")

    def _diverged(self, what: str) -> divergence.DivergedError:
        last = self.checkpointer.checkpoints() if self.checkpointer is not None else []
        return divergence.diverged(what, self.loop.step, self.loop.epoch + 1,
                                   str(last[-1].path) if last else None, self.cfg.optim.lr)

    def _report_epoch(self, record: dict[str, Any]) -> None:
        self._main_writes(lambda: report.append_jsonl(self.run_dir / report.METRICS_FILE,
                                                      record))
        epochs = self.cfg.train.epochs
        self._main_writes(lambda: progress.append_epoch_log(self.run_dir, record, epochs))
        log.info(progress.epoch_line(record, epochs))

    def _summary(self, seconds: float) -> dict[str, Any]:
        h = self.loop.history
        return {
            "epochs": len(h),
            "steps": self.loop.step,
            "final_test_acc": h[-1]["test_acc"] if h else float("nan"),
            "final_test_loss": h[-1]["test_loss"] if h else float("nan"),
            "best_test_acc": max((r["test_acc"] for r in h), default=float("nan")),
            "final_train_loss": h[-1]["train_loss"] if h else float("nan"),
            "train_time_s": seconds,
            "world_size": self.world.world_size,
            "engine": self.engine,
            "engine_requested": self.cfg.train.engine,
            "shard": getattr(self.model, "shard", "none"),
            "rank_peak_rss_mib": self.rank_peak_rss_mib,
            "optimizer_state_mib": state_bytes(self.optimizer) / 2**20,
            "wrapper": f"{type(self.model).__module__}.{type(self.model).__name__}",
            "num_parameters": self.num_parameters,
            "global_batch_size": self.cfg.train.batch_size,
            "data": self.cfg.data.name,
            "model": self.cfg.model.name,
            "seed": self.cfg.train.seed,
        }

    def _progress(self, epoch: int, total: int | None):
        if not (self.cfg.train.progress and self.world.is_main and self.write):
            return None
        # To the launcher's progress file under ddpkit train/launch, else a tqdm bar.
        return progress.open_bar(self, epoch, total)


class _EpochSums:
    """The epoch's running metric sums of every rank, for a checkpoint taken mid-epoch."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def state_dict(self) -> list[list[float]]:
        t = self.trainer  # a collective: the run saves on every rank
        sums = _gather_lists(t._sums.values() if t._sums else [0.0, 0.0, 0.0], t.device)
        t.refuse_non_finite_state(sums)  # nothing non-finite is ever saved as good
        return sums

    def load_state_dict(self, sums: list[list[float]]) -> None:
        t = self.trainer
        if len(sums) == t.world.world_size:
            mine = sums[t.world.rank]
        else:  # other world size: the epoch's job-wide totals stay exact on rank 0
            mine = [sum(col) for col in zip(*sums)] if t.world.is_main and sums else [0.0] * 3
        t._resumed_sums = MetricSums.from_values(list(mine), t.device)


def _gather_lists(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's short list of floats, by rank (a collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _to_device(ds: ArrayDataset, device: torch.device) -> ArrayDataset:
    if device.type == "cpu":
        return ds
    # Small in-memory datasets: move once, not every batch.
    return ArrayDataset(ds.x.to(device), ds.y.to(device), ds.num_classes, ds.name)
