"""The training loop: seed 004's synchronous SGD with the parts a real run needs.

Each epoch every rank trains on its shard of the global batches (ShardSampler), the
engine averages gradients, then every rank evaluates its shard of the test set and the
metric sums are reduced (see metrics.py). Rank 0 alone draws the progress bar and writes
the run directory: ``config.json``, ``metrics.jsonl`` (one record per epoch),
``summary.json`` and ``curves.png``.

The loss that drives backward is the sum over this rank's *real* samples scaled by
``world_size / real samples in the global batch``: after the engine averages over ranks
the gradient is exactly that of the mean loss over the global batch, also for a padded
last batch, so W processes take the same steps as one process would.

Everything needed to continue the loop lives in :class:`LoopState` (epoch, step,
sampler position, history); :meth:`Trainer.state_dict` adds the model and optimizer.
That is the seam for checkpoint/resume, and ``step_callbacks`` run after every step.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.data.datasets import ArrayDataset, load_dataset
from ddpkit.data.partition import ShardBatch, ShardSampler
from ddpkit.log import get_logger
from ddpkit.train import report
from ddpkit.train.config import Config
from ddpkit.train.metrics import MetricSums, gather_floats
from ddpkit.train.models import build_model
from ddpkit.world import World

log = get_logger(__name__)

Wrap = Callable[[nn.Module, str, torch.device], nn.Module]


def data_parallel(module: nn.Module, engine: str, device: torch.device) -> nn.Module:
    """Wrap ``module`` for data parallelism with the chosen engine, in one call.

    ``ddpkit.parallel.data_parallel`` switches between our engine and torch's; while that
    module is not available, torch's DistributedDataParallel stands in for both.
    """
    try:
        from ddpkit.parallel import data_parallel as factory
    except ImportError:
        factory = None
    if factory is not None:
        return factory(module, engine=engine)
    if engine != "torch":
        log.warning_once(f"engine {engine!r} is not available in this build; using torch DDP")
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


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
    ``write=False`` to keep everything in memory (tests, verify).
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
        torch.set_num_threads(t.threads or default_threads(world))
        self.device = torch.device(world.device)
        train_set, test_set = datasets or load_dataset(
            cfg.data.name, cfg.data.data_dir, synthetic_size=cfg.data.synthetic_size
        )
        self.train_set = _to_device(train_set, self.device)
        self.test_set = _to_device(test_set, self.device)

        torch.manual_seed(t.seed)  # same initial weights on every rank (and vs. 1 process)
        module = build_model(cfg.model.name, train_set.input_shape, train_set.num_classes,
                             hidden=cfg.model.hidden).to(self.device)
        self.model = (wrap or data_parallel)(module, t.engine, self.device)
        # What actually runs, which can differ from the request (see data_parallel).
        self.engine = "torch" if type(self.model).__module__.startswith("torch.") else t.engine
        # Dropout masks should differ between ranks but still follow from the seed.
        torch.manual_seed(t.seed + 1 + world.rank)
        self.optimizer = torch.optim.SGD(unwrap(self.model).parameters(), lr=cfg.optim.lr,
                                         momentum=cfg.optim.momentum,
                                         weight_decay=cfg.optim.weight_decay)
        self.sampler = ShardSampler(train_set, global_batch_size=t.batch_size,
                                    num_replicas=world.world_size, rank=world.rank,
                                    seed=t.seed, drop_last=cfg.data.drop_last)
        eval_batch = math.ceil(t.eval_batch_size / world.world_size) * world.world_size
        self.test_sampler = ShardSampler(test_set, global_batch_size=eval_batch,
                                         num_replicas=world.world_size, rank=world.rank,
                                         shuffle=False)
        self.loop = LoopState(sampler=self.sampler.state_dict())
        self.step_callbacks: list[Callable[[Trainer], None]] = []
        self.write = write
        self.run_dir = self._make_run_dir(run_dir) if write else None

    # ------------------------------------------------------------------ setup
    def _make_run_dir(self, run_dir: str | os.PathLike | None) -> Path:
        if run_dir is not None:
            path = Path(run_dir)
            if self.world.is_main:
                path.mkdir(parents=True, exist_ok=True)
            return path
        name = [None]
        if self.world.is_main:
            tag = f"{self.cfg.data.name}-{self.cfg.model.name}-w{self.world.world_size}"
            name[0] = str(report.new_run_dir(self.cfg.train.out_dir, tag))
        if dist.is_initialized() and self.world.world_size > 1:
            dist.broadcast_object_list(name, src=0)
        return Path(name[0])

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in unwrap(self.model).parameters())

    # ------------------------------------------------------------------ state (resume seam)
    def state_dict(self) -> dict[str, Any]:
        self.loop.sampler = self.sampler.state_dict()
        return {"model": unwrap(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "loop": self.loop.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loop.load_state_dict(state["loop"])
        self.sampler.load_state_dict(self.loop.sampler)

    # ------------------------------------------------------------------ steps
    def train_epoch(self) -> dict[str, Any]:
        self.model.train()
        epoch = self.loop.epoch
        if self.sampler.epoch < epoch:
            self.sampler.set_epoch(epoch)
        # A state saved right after an epoch's last step has the sampler already in the
        # next epoch (position 0): that epoch's training is done, only evaluation is left.
        batches = self.sampler.batches() if self.sampler.epoch == epoch else iter(())
        sums = MetricSums(self.device)
        total = len(self.train_set) if self.sampler.position == 0 else None
        bar = self._progress(epoch, total)
        start = time.perf_counter()
        seen = 0
        for batch in batches:
            self.train_step(batch, sums)
            self.loop.step += 1
            self.loop.sampler = self.sampler.state_dict()
            seen += batch.global_num_real
            if bar is not None:
                bar.update(batch.global_num_real)
            for callback in self.step_callbacks:
                callback(self)
        seconds = time.perf_counter() - start
        if bar is not None:
            bar.close()
        totals = sums.reduce()
        mine = sums.local()
        return {
            "train_loss": totals.loss,
            "train_acc": totals.accuracy,
            "train_samples": int(totals.count),
            "rank_train_loss": gather_floats(mine.loss, self.device),
            "rank_train_samples": [int(v) for v in gather_floats(mine.count, self.device)],
            "train_time_s": seconds,
            "samples_per_s": seen / seconds if seconds > 0 else float("nan"),
        }

    def train_step(self, batch: ShardBatch, sums: MetricSums) -> None:
        x, y = self.train_set.batch(batch.indices)
        self.optimizer.zero_grad(set_to_none=True)
        # Every rank runs forward/backward on its whole batch, padding included, so the
        # engine's collectives line up; only real samples carry loss.
        out = self.model(x)
        losses = F.nll_loss(out, y, reduction="none")[: batch.num_real]
        scale = self.world.world_size / batch.global_num_real
        (losses.sum() * scale).backward()
        self.optimizer.step()
        correct = out[: batch.num_real].argmax(dim=1) == y[: batch.num_real]
        sums.add(losses, correct)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Test loss/accuracy over the whole test set, padding excluded (a collective)."""
        model = unwrap(self.model)  # weights are in sync: no engine, no collectives
        model.eval()
        sums = MetricSums(self.device)
        self.test_sampler.set_epoch(0)
        for batch in self.test_sampler.batches():
            x, y = self.test_set.batch(batch.indices[: batch.num_real])
            out = model(x)
            sums.add(F.nll_loss(out, y, reduction="none"), out.argmax(dim=1) == y)
        totals = sums.reduce()
        model.train()
        return {"test_loss": totals.loss, "test_acc": totals.accuracy,
                "test_samples": int(totals.count)}

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        t = self.cfg.train
        started = time.perf_counter()
        if self.write and self.world.is_main:
            report.write_json(self.run_dir / report.CONFIG_FILE,
                              {**self.cfg.to_dict(), "world_size": self.world.world_size})
            log.info(f"run directory: {self.run_dir}")
            log.info(
                f"{self.cfg.data.name} ({len(self.train_set)} train / {len(self.test_set)} test), "
                f"model {self.cfg.model.name} ({self.num_parameters:,} parameters), "
                f"{self.world.world_size} rank(s) x {self.sampler.local_batch_size} = global batch "
                f"{t.batch_size}, engine {self.engine}"
            )
        while self.loop.epoch < t.epochs:
            record = {"epoch": self.loop.epoch + 1}
            record.update(self.train_epoch())
            record.update(self.evaluate())
            record["step"] = self.loop.step
            record["time_s"] = time.perf_counter() - started
            self.loop.history.append(record)
            self.loop.epoch += 1
            self._report_epoch(record)
        summary = self._summary(time.perf_counter() - started)
        if self.write and self.world.is_main:
            report.write_json(self.run_dir / report.SUMMARY_FILE, summary)
            report.plot_curves(self.loop.history, self.run_dir / report.PLOT_FILE,
                               title=f"{self.cfg.data.name} / {self.cfg.model.name}, "
                                     f"{self.world.world_size} ranks")
            log.info(
                f"done: test accuracy {100 * summary['final_test_acc']:.2f}% "
                f"(best {100 * summary['best_test_acc']:.2f}%) after {summary['epochs']} epochs, "
                f"{summary['train_time_s']:.1f} s; results in {self.run_dir}"
            )
        return summary

    def _report_epoch(self, record: dict[str, Any]) -> None:
        if self.write and self.world.is_main:
            report.append_jsonl(self.run_dir / report.METRICS_FILE, record)
        ranks = ", ".join(f"{v:.4f}" for v in record["rank_train_loss"])
        log.info(
            f"epoch {record['epoch']}/{self.cfg.train.epochs}: "
            f"train loss {record['train_loss']:.4f} acc {100 * record['train_acc']:.2f}% | "
            f"test loss {record['test_loss']:.4f} acc {100 * record['test_acc']:.2f}% | "
            f"{record['samples_per_s']:,.0f} samples/s | loss by rank [{ranks}]"
        )

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
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        # Under torchrun's --tee the stream is a file read line by line: redraws with
        # "\r" would pile up into one line, so there we print whole lines, rarely.
        return tqdm(total=total, desc=f"epoch {epoch + 1}/{self.cfg.train.epochs}",
                    unit="sample", unit_scale=True, leave=False,
                    file=sys.stderr if tty else _LineWriter(sys.stderr),
                    dynamic_ncols=tty, ncols=None if tty else 90,
                    mininterval=0.5 if tty else 10.0, delay=1.0 if tty else 5.0)


class _LineWriter:
    """File-like for tqdm that turns each redraw into one plain line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.strip("\r\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _to_device(ds: ArrayDataset, device: torch.device) -> ArrayDataset:
    if device.type == "cpu":
        return ds
    # Small in-memory datasets: move once, not every batch.
    return ArrayDataset(ds.x.to(device), ds.y.to(device), ds.num_classes, ds.name)
