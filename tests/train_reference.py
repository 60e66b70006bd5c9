"""Uninterrupted reference runs of ``ddpkit train`` jobs, trained on the shared gloo pool.

A test that kills, stops or resumes a launched ``ddpkit train`` compares how it ends with
an uninterrupted run of the same job, bit for bit. That run needs no launcher: the
Trainer on pooled ranks of the same world size, given the configuration the worker
entry resolves from the same options, computes the same bits, without the seconds a
launch spends starting an agent and its ranks. Each configuration is trained once per
session (the ``train_reference`` fixture in conftest.py); the faulted runs stay true
launches, so a launch that computed differently still fails their comparison.
"""

from __future__ import annotations

from pathlib import Path


def train_in_pool(world, argv: list[str], run_dir: str) -> int:
    """Train the job that ``ddpkit train`` options ``argv`` describe (no launcher
    options) on this pooled rank, writing ``run_dir`` as a launched run does; the number
    of optimizer steps it made."""
    from ddpkit.train.options import config_from_args
    from ddpkit.train.trainer import Trainer
    from ddpkit.train.worker import worker_parser

    # The worker entry's own parser and resolution: options mean here what they mean
    # to a launched worker.
    cfg = config_from_args(worker_parser().parse_args([*argv, "--run-dir", run_dir]))
    trainer = Trainer(cfg, world, run_dir=Path(run_dir))
    trainer.fit()
    return trainer.run.step
