"""Rank 0's progress: during an epoch, to the launcher or drawn here; at its end, one
line for the terminal and one, with every rank's detail, for the run's log.

At an epoch's end rank 0 prints :func:`epoch_line` (the losses, accuracies and speed:
short enough for a terminal) and appends :func:`epoch_log_line` to ``train.log`` in the
run directory: the same with the time, each rank's own training loss and each rank's
peak memory, which a person needs when ranks disagree but not on every epoch's line.

Under ``ddpkit train``/``ddpkit launch`` rank 0's output reaches the terminal through
the launcher's pipes, so a bar drawn here would never be live. The launcher names a
file in ``DDPKIT_PROGRESS_FILE`` instead: :class:`FileBar` appends one small JSON record
to it a few times a second (step, total steps, epoch, samples/s, the epoch's running
loss) and the launcher draws it (``ddpkit.launcher.console``): a live status line on a terminal,
a plain line every few steps otherwise. Each record carries the time left, estimated
from the whole run so far (evaluations included), so the launcher's first line already
has a real ETA.

Under another launcher (plain torchrun, srun, mpirun) there is no such file: a tqdm bar
on stderr, redrawn in place on a terminal and as a whole line every 10 s otherwise.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from ddpkit.files.durable import append_line
from ddpkit.launcher.console import PROGRESS_ENV
from ddpkit.loop.metrics_log import peak_rss_mib

WRITE_EVERY_S = 0.25  # records per second to the launcher, at most about 4
LOG_FILE = "train.log"  # in the run directory: a line per epoch (a resumed run appends)


def epoch_line(record: dict[str, Any], epochs: int) -> str:
    """``epoch 3/20: train loss 0.4123 acc 88.10% | test loss 0.3911 acc 89.02% | 8,123
    samples/s``: what rank 0 prints when an epoch ends."""
    return (f"epoch {record['epoch']}/{epochs}: "
            f"train loss {record['train_loss']:.4f} acc {100 * record['train_acc']:.2f}% | "
            f"test loss {record['test_loss']:.4f} acc {100 * record['test_acc']:.2f}% | "
            f"{record['samples_per_s']:,.0f} samples/s")


def epoch_log_line(record: dict[str, Any], epochs: int, now: float | None = None) -> str:
    """The epoch's line in ``train.log``: the local time, :func:`epoch_line`, every
    rank's training loss of the epoch and every rank's peak RSS so far."""
    losses = ", ".join(f"{v:.4f}" for v in record["rank_train_loss"])
    memory = ", ".join(f"{v:.0f}" for v in record["rank_peak_rss_mib"])
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    return (f"{stamp} {epoch_line(record, epochs)} | loss by rank [{losses}] | "
            f"peak RSS by rank [{memory}] MiB")


def append_epoch_log(run_dir: str | os.PathLike, record: dict[str, Any], epochs: int) -> None:
    """Rank 0: the epoch's line at the end of the run's ``train.log``."""
    append_line(Path(run_dir) / LOG_FILE, epoch_log_line(record, epochs))


def open_bar(trainer: Any, epoch: int, total: int | None) -> Any:
    """A bar for ``epoch`` with ``update(samples)`` and ``close()``; rank 0 only."""
    path = os.environ.get(PROGRESS_ENV)
    if path:
        return FileBar(path, trainer, epoch)
    return _tqdm_bar(trainer.cfg.train.epochs, epoch, total)


class FileBar:
    """Appends progress records for the launcher to draw (see the module docstring)."""

    def __init__(self, path: str, trainer: Any, epoch: int):
        self.trainer, self.epoch = trainer, epoch
        self.start = self.last = time.perf_counter()
        # The run's clock starts with its first bar: (time, step) the ETA is measured from.
        if trainer.progress_clock is None:
            trainer.progress_clock = (self.start, trainer.run.step)
        self.seen = 0
        try:
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        except OSError:
            self.file = None  # no launcher to read it any more: stay quiet

    def update(self, samples: int) -> None:
        self.seen += samples
        now = time.perf_counter()
        if now - self.last >= WRITE_EVERY_S:
            self.last = now
            self._write(now)

    def close(self) -> None:
        if self.file is not None:
            self._write(time.perf_counter())
            self.file.close()
            self.file = None

    def _write(self, now: float) -> None:
        if self.file is None:
            return
        t = self.trainer
        sums = getattr(t, "_sums", None)
        loss = sums.local().loss if sums is not None else float("nan")
        elapsed = now - self.start
        total = getattr(t, "total_steps", None)
        t0, s0 = t.progress_clock
        eta = (total - t.run.step) * (now - t0) / (t.run.step - s0) if (
            total and t.run.step > s0) else None
        record = {"step": t.run.step, "total_steps": total,
                  "epoch": self.epoch + 1, "epochs": t.cfg.train.epochs,
                  "samples_per_s": self.seen / elapsed if elapsed > 0 else None,
                  "loss": loss if math.isfinite(loss) else None, "eta_s": eta,
                  # every rank's peak as of the last epoch's metrics, this rank's now
                  "peak_rss_mib": _with_mine(getattr(t, "rank_peak_rss_mib", None))}
        try:
            self.file.write(json.dumps(record) + "\n")
        except OSError:
            self.file = None


def _with_mine(by_rank: list[float] | None) -> list[float]:
    """Every rank's peak RSS, with this rank's (rank 0's) own brought up to now."""
    values = list(by_rank) if by_rank else [0.0]
    values[0] = max(values[0], peak_rss_mib())
    return [round(v) for v in values]


def _tqdm_bar(epochs: int, epoch: int, total: int | None) -> Any:
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    # On a pipe or file redraws with "\r" would pile up into one line, so there we print
    # whole lines, rarely.
    return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}",
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
