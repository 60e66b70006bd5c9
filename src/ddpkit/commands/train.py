"""``ddpkit train``: the main job - seed 004's synchronous SGD on real data.

Run plainly, it launches itself on N local processes through torchrun's agent
(``ddpkit.launch``; default one per GPU, or 2 on CPU) with ``python -m
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

from ddpkit.commands.launch import add_launch_options, options_from_args
from ddpkit.data.datasets import DATASETS
from ddpkit.errors import ConfigError
from ddpkit.train.config import ENGINES, Config, resolve
from ddpkit.train.models import MODELS

WORKER_MODULE = "ddpkit.train.worker"


def add_train_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `train`, `verify` and the worker. Defaults live in the
    dataclasses (train/config.py), so every flag defaults to None = "not given"."""
    g = p.add_argument_group("training (command line > --config file > defaults)")
    g.add_argument("--config", metavar="FILE.toml", default=None,
                   help="TOML file with [data] [model] [optim] [train] tables")
    g.add_argument("--data", choices=DATASETS, default=None, help="dataset (default: digits)")
    g.add_argument("--data-dir", default=None, help="directory with the MNIST IDX files")
    g.add_argument("--synthetic-size", type=int, default=None, metavar="N",
                   help="training samples of --data synthetic (default: 8192)")
    g.add_argument("--model", choices=MODELS, default=None, help="model (default: mlp)")
    g.add_argument("--hidden", type=int, nargs="+", default=None, metavar="H",
                   help="MLP hidden layer widths (default: 128)")
    g.add_argument("--epochs", type=int, default=None, help="epochs (default: 20)")
    g.add_argument("--batch-size", type=int, default=None,
                   help="GLOBAL batch size, split evenly over all ranks (default: 128)")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.1)")
    g.add_argument("--momentum", type=float, default=None, help="SGD momentum (default: 0.9)")
    g.add_argument("--seed", type=int, default=None, help="seed for weights and data order")
    g.add_argument("--engine", choices=ENGINES, default=None,
                   help="data-parallel engine: ddpkit's DataParallel or torch's DDP")
    g.add_argument("--out-dir", default=None,
                   help="parent of the new run directory (default: runs/)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: cores / local processes)")
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                   default=None, help="no progress bar")


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Checkpoint, resume and fault-tolerance options of `train` and the worker."""
    from ddpkit.train.resume import LATEST

    g = p.add_argument_group("checkpoints and fault tolerance (docs/checkpoints.md)")
    g.add_argument("--resume", nargs="?", const=LATEST, default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest good checkpoint, with its own "
                        "settings (options given here override them); without RUN_DIR: "
                        "the most recently checkpointed run under --out-dir")
    g.add_argument("--run-dir", default=None, metavar="DIR",
                   help="write this run into DIR (new or empty) instead of a new directory "
                        "under --out-dir; multi-node runs with --max-restarts need it")
    g.add_argument("--checkpoint-every-steps", type=int, default=None, metavar="N",
                   help="also checkpoint every N steps (always: at every epoch's end)")
    g.add_argument("--checkpoint-every-seconds", type=float, default=None, metavar="S",
                   help="also checkpoint when S seconds passed since the last one")
    g.add_argument("--keep", type=int, default=None, metavar="K",
                   help="checkpoints kept (default: 3)")
    g.add_argument("--no-checkpoints", dest="checkpoints", action="store_const", const=False,
                   default=None, help="write no checkpoints (such a run cannot be resumed)")
    g.add_argument("--collective-timeout", type=float, default=None, metavar="S",
                   help="fail, naming the ranks that did not arrive, when a collective waits "
                        "longer than S seconds (default: 600)")
    g.add_argument("--log-sample-ids", action="store_const", const=True, default=None,
                   help="write the sample ids of every step, per rank, to "
                        "<run dir>/sample_ids/ (to audit that none is lost or repeated)")


def config_from_args(args: argparse.Namespace, resume_dir: Path | None = None) -> Config:
    """Defaults < the resumed run's own config < --config file < command line."""
    base = None
    if resume_dir is not None:
        from ddpkit.train.resume import read_run_config

        base = read_run_config(resume_dir)
    return resolve(vars(args), args.config, base=base,
                   base_source=f"{resume_dir}/config.json")


def check_world_size(cfg: Config, opts) -> None:
    """Catch a global batch the ranks cannot split before any process starts."""
    from ddpkit.data.partition import local_batch_size
    from ddpkit.launch import default_nproc

    nproc = opts.nproc_per_node if opts.nproc_per_node is not None else default_nproc()
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be a positive integer, got {nproc}")
    if ":" in opts.nnodes:  # elastic: the world size is only known at rendezvous
        return
    try:
        nnodes = int(opts.nnodes)
    except ValueError:
        raise ConfigError(f"--nnodes {opts.nnodes!r} is not N or MIN:MAX") from None
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}")
    local_batch_size(cfg.train.batch_size, nproc * nnodes)


# Sample shape of each dataset, to check the model fits before any process starts.
INPUT_SHAPES = {"digits": (1, 8, 8), "synthetic": (1, 8, 8), "mnist": (1, 28, 28)}


def check_data(cfg: Config) -> None:
    """Fail early on a missing or malformed dataset or a model that does not fit it
    (the workers would all fail later, each with the same message)."""
    from ddpkit.train.models import build_model

    build_model(cfg.model.name, INPUT_SHAPES[cfg.data.name], 10, hidden=cfg.model.hidden)
    if cfg.data.name == "mnist":
        from ddpkit.data.datasets import load_mnist

        if cfg.data.data_dir is None:
            from ddpkit.data.datasets import load_dataset

            load_dataset("mnist", None)  # raises the "needs --data-dir" error
        load_mnist(cfg.data.data_dir)


def quiet_omp_warning(opts) -> None:
    """torchrun warns on every launch unless OMP_NUM_THREADS is set; set what the trainer
    would pick anyway (cores shared by the local processes)."""
    import os

    from ddpkit.launch import default_nproc

    if "OMP_NUM_THREADS" not in os.environ:
        nproc = opts.nproc_per_node or default_nproc()
        opts.extra_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model on N processes (seed 004's synchronous SGD)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_options(p)
    add_run_options(p)
    add_launch_options(p)
    p.set_defaults(func=run)


def prepare_run_dir(cfg: Config, run_dir: str | None, single_node: bool,
                    world_size: int) -> Path | None:
    """The run directory, made before launching so restarted workers share it.

    Multi-node without ``--run-dir``: each node's launcher would make its own, so rank 0
    of the job makes one instead (and restarts cannot find its checkpoints).
    """
    from ddpkit.train import report

    if run_dir is not None:
        path = Path(run_dir)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ConfigError(f"--run-dir {path} already exists and is not empty; continue "
                              f"that run with --resume {path}, or choose a new directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--run-dir {path}: cannot create it ({exc.strerror})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"--run-dir {path} is not writable; choose another")
        return path
    report.check_out_dir(cfg.train.out_dir)
    if not single_node:
        return None
    tag = f"{cfg.data.name}-{cfg.model.name}-w{world_size}"
    return report.new_run_dir(cfg.train.out_dir, tag)


def _child_pids() -> list[int]:
    """This process's children (the workers torchrun's agent started), from /proc."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == me:
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def forward_to_workers(signals: tuple[int, ...]) -> Iterator[None]:
    """Pass ``signals`` on to the workers. torchrun's agent forwards SIGTERM itself
    (and then stops); SIGUSR1, SLURM's early warning, would otherwise end the agent
    and orphan its workers."""
    def forward(signum, frame):
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ddpkit.fault import EXIT_PREEMPTED
    from ddpkit.launch import default_nproc, launch
    from ddpkit.log import get_logger
    from ddpkit.train import resume
    from ddpkit.train.worker import WorkerPlan
    from ddpkit.world import World

    resume_dir = None
    if args.resume is not None:
        if args.run_dir is not None:
            raise ConfigError("--resume and --run-dir: give one (--resume RUN_DIR continues "
                              "RUN_DIR; --run-dir starts a new run there)")
        out_dir = args.out_dir
        if out_dir is None and args.resume == resume.LATEST:
            out_dir = resolve(vars(args), args.config).train.out_dir
        resume_dir = resume.find_run_dir(args.resume, out_dir or "runs")
    cfg = config_from_args(args, resume_dir)
    if World.from_env(require_master_addr=False).source != "single":
        from ddpkit.train.worker import run_worker

        plan = WorkerPlan.from_env(os.environ, resume_dir or args.run_dir, resume_dir is not None)
        return run_worker(cfg, plan, os.environ)
    opts = options_from_args(args)
    check_world_size(cfg, opts)
    if resume_dir is not None:
        resume.check_resumable(resume_dir, cfg)
    check_data(cfg)
    single_node = opts.nnodes in ("1", "1:1")
    run_dir = resume_dir
    if run_dir is None:
        nproc = opts.nproc_per_node or default_nproc()
        run_dir = prepare_run_dir(cfg, args.run_dir, single_node, nproc)
    if run_dir is None and opts.max_restarts > 0:
        get_logger(__name__).warning(
            "--max-restarts on several nodes without --run-dir: restarted workers will "
            "start over; pass the same --run-dir (on a shared filesystem) on every node")
    argv = ["--resolved-config", json.dumps(cfg.to_dict())]
    if run_dir is not None:
        argv += ["--resume" if resume_dir is not None else "--run-dir", str(run_dir)]
    opts.module = True
    quiet_omp_warning(opts)
    started = time.time()
    try:
        with forward_to_workers((signal.SIGUSR1,)):
            code = launch(WORKER_MODULE, argv, opts)
    except SignalException as err:  # the agent forwarded it, the workers have stopped
        code = 128 + int(err.sigval)
    stopped = resume.preempted_since(run_dir, started) if run_dir is not None else None
    if stopped is not None:
        print(f"ddpkit train: stopped by a signal at step {stopped.step}; checkpoint "
              f"{stopped.path}; continue with: ddpkit train --resume {run_dir}",
              file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return code
