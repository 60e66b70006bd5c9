"""``ddpkit train``: the main job - synchronous data-parallel SGD on real data.

Run plainly, it launches itself on N local processes through torchrun's agent
(``ddpkit.launcher.launch``; default one per GPU, or 2 on CPU) with ``python -m
ddpkit.train.worker``. Run under a launcher (torchrun, srun, mpirun) it is one worker.
Options, the config file, the data and a run to resume are checked here, before any
process starts.

Checkpoints go to <run dir>/checkpoints (every epoch, and --checkpoint-every-steps /
--checkpoint-every-seconds). --resume [RUN_DIR] continues a run; with --max-restarts K
workers that die are restarted and continue from the last checkpoint. SIGTERM or
SIGUSR1 stop every rank at the next step with a checkpoint, and the command exits 75.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ddpkit.commands.launch import options_from_args
from ddpkit.errors import ConfigError
from ddpkit.launcher.torchrun_args import add_launch_options
from ddpkit.runtime.launcher_link import child_pids
from ddpkit.train import report
from ddpkit.train.config import Config
from ddpkit.train.options import add_run_options, add_train_options, config_from_args
from ddpkit.train.run_plan import RunPlan

WORKER_MODULE = "ddpkit.train.worker"

DESCRIPTION = """\
Train a model with synchronous data-parallel SGD on sharded data. Run plainly, it starts
N local processes (one per GPU, or 2 on CPU) under torchrun's elastic agent; started by
a launcher (torchrun, srun, mpirun) it is one of the workers. Options, the config file,
the data and a run to resume are checked before any process starts.

Results go to a new directory under --out-dir: metrics.jsonl, summary.json, curves.png,
the final weights in model.pt and checkpoints/ (one per epoch, more with
--checkpoint-every-steps or --checkpoint-every-seconds). --resume [RUN_DIR] continues a
run; with --max-restarts K, workers that die are restarted from the last checkpoint.
SIGTERM or SIGUSR1 stop every rank at the next step with a checkpoint (exit status 75).
"""


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model on N processes (synchronous data-parallel SGD)",
                       description=DESCRIPTION)
    add_train_options(p)
    add_run_options(p)
    add_launch_options(p)
    p.add_argument("--rdzv-timeout", type=float, default=None, metavar="SECONDS",
                   help="several nodes: how long to wait for the first node to answer and "
                        "for every node to join (default: 60 s to answer, 600 s to join)")
    p.set_defaults(func=run)


@contextlib.contextmanager
def forward_to_workers(signals: tuple[int, ...]) -> Iterator[None]:
    """Pass ``signals`` on to the workers. torchrun's agent forwards SIGTERM itself
    (and then stops); SIGUSR1, SLURM's early warning, would otherwise end the agent
    and orphan its workers."""
    def forward(signum, frame):
        for pid in child_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _finished_since(run_dir: Path, started: float) -> bool:
    """Whether the run wrote its summary (the last word of a finished run) since ``started``."""
    from ddpkit.train.report import SUMMARY_FILE

    try:
        return (run_dir / SUMMARY_FILE).stat().st_mtime >= started
    except OSError:
        return False


def run(args: argparse.Namespace) -> int:
    # Imports that need torch wait until they are needed: the launching process of a
    # default run never imports it (the workers do).
    from ddpkit.launcher.launch import default_nproc
    from ddpkit.runtime.world import World
    from ddpkit.train.prelaunch import check_data, check_launch, check_world_size

    # Only who started this process matters here, not its devices (which need torch).
    if World.from_env(require_master_addr=False, accelerator="cpu",
                      device_count=0).source != "single":
        from ddpkit.runtime.process_exit import exit_process
        from ddpkit.train.worker import run_from_args

        # One worker of a job some launcher started (torchrun, srun, mpirun); it ends as
        # every worker does (a success skips finalization, which can abort in gloo).
        exit_process(run_from_args(args))

    plan = RunPlan.from_args(args, launching=True)
    cfg = config_from_args(args, plan.resume_dir)
    opts = options_from_args(args)
    if args.rdzv_timeout is not None:
        if not args.rdzv_timeout > 0:
            raise ConfigError(f"--rdzv-timeout must be > 0 seconds, got {args.rdzv_timeout}")
        opts.rdzv_timeout = args.rdzv_timeout
    check_world_size(cfg, opts)
    check_launch(cfg, opts)
    check_data(cfg)
    single_node = opts.nnodes in ("1", "1:1")
    if plan.run_dir is None:
        report.check_out_dir(cfg.train.out_dir)
    if plan.run_dir is not None or single_node:
        # Made before launching so restarted workers share it. Several nodes without
        # --run-dir: each node's launcher would make its own, so rank 0 of the job does.
        plan = plan.made(cfg, opts.nproc_per_node or default_nproc())
    # One writer per run directory; the workers of this launcher write under its lock.
    # (Several nodes cannot all hold it: there rank 0 of the job takes it.)
    lock = plan.lock() if single_node else None
    if lock is not None:
        opts.extra_env.update(lock.vouch())
    with lock or contextlib.nullcontext():
        return _launch(args, cfg, opts, plan)


def _launch(args: argparse.Namespace, cfg: Config, opts, plan: RunPlan) -> int:
    from ddpkit.exit_codes import EXIT_PREEMPTED
    from ddpkit.launcher.launch import launch
    from ddpkit.log import get_logger
    from ddpkit.train import resume
    from ddpkit.train.prelaunch import quiet_omp_warning

    run_dir = plan.run_dir
    if plan.resume:
        info = resume.check_resumable(run_dir, cfg)
        if plan.rerun:
            print(f"ddpkit train: --run-dir {run_dir} holds this run, stopped at step "
                  f"{info.step}: continuing it", file=sys.stderr, flush=True)
    if run_dir is None and opts.max_restarts > 0:
        get_logger(__name__).warning(
            "--max-restarts on several nodes without --run-dir: restarted workers will "
            "start over; pass the same --run-dir (on a shared filesystem) on every node")
    argv = ["--resolved-config", json.dumps(cfg.to_dict())]
    if run_dir is not None:
        argv += ["--resume" if plan.resume else "--run-dir", str(run_dir)]
    opts.module = True
    opts.plain_terminal = True  # a person reads this terminal (ddpkit.launcher.launch)
    quiet_omp_warning(opts)
    started = time.time()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        with forward_to_workers((signal.SIGUSR1,)):
            code = launch(WORKER_MODULE, argv, opts)
    except SignalException as err:  # the agent forwarded it, the workers have stopped
        code = 128 + int(err.sigval)
    if code > 128 and run_dir is not None and _finished_since(run_dir, started):
        # The signal came while the agent was winding down a run that had just ended.
        print(f"ddpkit train: the run had finished when the signal came; results in "
              f"{run_dir}", file=sys.stderr, flush=True)
        return 0
    # Under the agent a stopped worker exits 0 (or the agent reports the signal), so the
    # newest checkpoint tells whether the run was stopped.
    stopped = resume.preempted_since(run_dir, started) if run_dir is not None else None
    if stopped is not None:
        again = " (or the same command again)" if plan.recheck else ""
        print(f"ddpkit train: stopped by a signal at step {stopped.step}; checkpoint "
              f"{stopped.path}; continue with: ddpkit train --resume {run_dir}{again}",
              file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return code
