"""What rank 0 of ``ddpkit train`` leaves in the run directory, and how every rank
learns that it did: the directory itself (made and locked by rank 0, its name agreed
by all), the results of a finished run (weights first, then ``summary.json`` and
``curves.png``), and a failed write there (a full disk) ending every rank alike.

Functions of the :class:`~ddpkit.train.trainer.Trainer` whose files they write.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint import CheckpointError
from ddpkit.checkpoint.model_state import unwrap
from ddpkit.files.durable import DiskFullError, free_bytes, is_disk_full
from ddpkit.loop.rank0 import cannot_create, decide_on_rank0
from ddpkit.parallel.zero.sharded_state import state_bytes
from ddpkit.train import report
from ddpkit.train.run_plan import RunPlan

# The trainer these act for (a ddpkit.train.trainer.Trainer, which imports this module).
Trainer = Any


def agree_on_run(trainer: Trainer, plan: RunPlan) -> str | None:
    """Rank 0 creates the run directory (unless ``write=False``) and holds it; every
    rank learns its name, or every rank raises rank 0's error (none is left waiting)."""
    def create() -> str | None:
        if not trainer.write:
            return None
        try:
            made = plan.made(trainer.cfg, trainer.world.world_size)
            trainer.run_lock = made.lock()  # None where the launcher holds it for us
        except OSError as err:
            where = plan.run_dir if plan.run_dir is not None else trainer.cfg.train.out_dir
            raise cannot_create(where, err) from None
        return str(made.run_dir)

    return decide_on_rank0(create, is_main=trainer.world.is_main,
                           world_size=trainer.world.world_size)


def disk_full(trainer: Trainer, err: BaseException) -> DiskFullError:
    """``err`` as a DiskFullError that says how to go on from here."""
    if not isinstance(err, DiskFullError):  # a raw ENOSPC from a log append
        where = Path(getattr(err, "filename", None) or trainer.run_dir or ".")
        err = DiskFullError(where, None, free_bytes(where))
    if trainer.checkpointer is not None and trainer.write:
        if trainer.checkpointer.checkpoints():
            return err.with_advice(f"free some space there, then continue the run: "
                                   f"ddpkit train --resume {trainer.run_dir}")
        # --resume (or --run-dir, the same command again) refuses a run without one
        return err.with_advice(f"free some space there, remove {trainer.run_dir} (it holds "
                               f"no checkpoint to continue from) and start the run again")
    return err.with_advice("free some space there and start the run again")


def write_results(trainer: Trainer, summary: dict[str, Any]) -> None:
    # The weights first: a summary says the run is done, so it comes only once they
    # are safely on disk.
    report.save_model(unwrap(trainer.model).state_dict(), trainer.run_dir / report.MODEL_FILE)
    report.write_json(trainer.run_dir / report.SUMMARY_FILE, summary)
    report.plot_curves(trainer.history.records, trainer.run_dir / report.PLOT_FILE,
                       title=f"{trainer.cfg.data.name} / {trainer.cfg.model.name}, "
                             f"{trainer.world.world_size} ranks")


def main_writes(trainer: Trainer, write: Callable[[], None]) -> None:
    """Rank 0 runs ``write`` (files of the run directory); every rank learns how it
    went, so that a full disk there ends every rank with the same error rather than
    leaving the others to find rank 0 gone in their next collective."""
    if not trainer.write:
        return
    failure: BaseException | None = None
    if trainer.world.is_main:
        try:
            write()
        except Exception as err:
            failure = disk_full(trainer, err) if is_disk_full(err) else err
    if dist.is_initialized() and trainer.world.world_size > 1:
        told = [failure if isinstance(failure, DiskFullError) or failure is None else
                CheckpointError(f"rank 0 failed writing to {trainer.run_dir} "
                                f"({type(failure).__name__}: {failure}); see its error")]
        dist.broadcast_object_list(told, src=0)
        if failure is None and told[0] is not None:
            raise told[0]
    if failure is not None:
        raise failure


def summary(trainer: Trainer, seconds: float) -> dict[str, Any]:
    h = trainer.history.records
    return {
        "epochs": len(h),
        "steps": trainer.run.step,
        "final_test_acc": h[-1]["test_acc"] if h else float("nan"),
        "final_test_loss": h[-1]["test_loss"] if h else float("nan"),
        "best_test_acc": max((r["test_acc"] for r in h), default=float("nan")),
        "final_train_loss": h[-1]["train_loss"] if h else float("nan"),
        "train_time_s": seconds,
        "world_size": trainer.world.world_size,
        "engine": trainer.engine,
        "engine_requested": trainer.cfg.train.engine,
        "shard": getattr(trainer.model, "shard", "none"),
        "rank_peak_rss_mib": trainer.rank_peak_rss_mib,
        "optimizer_state_mib": state_bytes(trainer.optimizer) / 2**20,
        "wrapper": f"{type(trainer.model).__module__}.{type(trainer.model).__name__}",
        "num_parameters": trainer.num_parameters,
        "global_batch_size": trainer.cfg.train.batch_size,
        "data": trainer.cfg.data.name,
        "model": trainer.cfg.model.name,
        "seed": trainer.cfg.train.seed,
    }
