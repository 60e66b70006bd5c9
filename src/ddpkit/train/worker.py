"""One training process: ``python -m ddpkit.train.worker [train options]``.

``ddpkit train`` starts this on every rank with the already resolved configuration and
the run directory (so that restarted workers find their checkpoints); it also runs
directly under any launcher, e.g.
``torchrun --nproc-per-node 2 -m ddpkit.train.worker --epochs 5``.
``ddpkit train`` run under a launcher is this same entry (:func:`run_from_args`), so
every way in ends with the same exit codes (:mod:`ddpkit.train.entry`).

Restarts: torchrun's agent restarts every worker when one fails
(``--max-restarts``) and says which attempt this is in ``TORCHELASTIC_RESTART_COUNT``;
a restarted worker continues from the newest checkpoint of its run directory.
Exit status: 0 when done *or* stopped by a signal under torchrun (a non-zero exit
would make the agent restart the job on an allocation that is going away; ``ddpkit
train`` reports the preemption itself), :data:`EXIT_PREEMPTED` when stopped by a
signal with no agent (srun, mpirun), 2 on a user error, :data:`EXIT_HANG` on a hang.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddpkit.elastic import host_change
from ddpkit.exit_codes import EXIT_PREEMPTED
from ddpkit.loop.inject import step_hooks
from ddpkit.runtime.launcher_link import die_with_launcher
from ddpkit.runtime.process_exit import exit_process
from ddpkit.runtime.process_group import distributed
from ddpkit.train import host_report
from ddpkit.train.config import Config
from ddpkit.train.entry import run_entry
from ddpkit.train.options import (
    add_resolved_config,
    add_run_options,
    add_train_options,
    config_from_args,
)
from ddpkit.train.run_plan import RunPlan
from ddpkit.train.trainer import Trainer


@dataclass(frozen=True)
class WorkerPlan:
    """What this worker process is asked to do, read once at its entry."""

    run_dir: Path | None = None  # None: rank 0 makes a new one under --out-dir
    resume: bool = False  # continue from the run directory's newest checkpoint (required)
    restart_count: int = 0  # torchrun's attempt number: > 0 continues from a checkpoint
    under_agent: bool = False  # started by torchrun's agent (the agent reports preemption)

    @classmethod
    def from_env(cls, env: Mapping[str, str], run_dir: str | os.PathLike | None,
                 resume: bool) -> WorkerPlan:
        # torchrun's agent counts its restarts; SLURM counts requeues of the batch job.
        restarts = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT")
        # A later group of an elastic job continues like a restart, on a new host too.
        return cls(run_dir=Path(run_dir) if run_dir else None, resume=resume,
                   restart_count=max(int(restarts or 0), host_change.group_round(env)),
                   under_agent="TORCHELASTIC_RUN_ID" in env)


def run_worker(cfg: Config, plan: WorkerPlan | None = None,
               env: Mapping[str, str] | None = None) -> int:
    """Join the job's process group, train (or continue), always tear down."""
    plan = plan or WorkerPlan()
    with distributed() as world:
        trainer = Trainer(cfg, world, run_dir=plan.run_dir)
        # The DDPKIT_TEST_* faults (ddpkit.loop.inject) the fault-tolerance tests ask for.
        for hook in step_hooks(env or {}, world.rank, plan.restart_count,
                               lambda: trainer.preemption.requested):
            trainer.step_callbacks.append(lambda t, hook=hook: hook(t.run.step))
        if plan.resume or plan.restart_count > 0:
            trainer.restore(required=plan.resume)
        with host_report.reporting(trainer, env or {}):  # elastic jobs: the hosts' side
            trainer.fit()  # distributed() waits for every rank before tearing gloo down
    if trainer.preempted and not plan.under_agent:
        return EXIT_PREEMPTED
    return 0


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddpkit.train.worker")
    add_train_options(p)
    add_run_options(p)
    add_resolved_config(p)
    return p


def run_from_args(args: argparse.Namespace) -> int:
    """The worker, from parsed options: ``ddpkit train`` under a launcher comes here too."""
    def body() -> int:
        run = RunPlan.from_args(args, launching=False)
        cfg = config_from_args(args, run.resume_dir)
        plan = WorkerPlan.from_env(os.environ, run.run_dir, run.resume)
        return run_worker(cfg, plan, os.environ)

    return run_entry("train", body)


def main(argv: list[str] | None = None) -> int:
    return run_from_args(worker_parser().parse_args(argv))


if __name__ == "__main__":
    die_with_launcher()  # a killed launcher must not leave this process training headless
    exit_process(main())
