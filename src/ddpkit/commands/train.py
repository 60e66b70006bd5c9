"""``ddpkit train``: the main job - seed 004's synchronous SGD on real data.

Run plainly, it launches itself on N local processes through torchrun's agent
(``ddpkit.launch``; default one per GPU, or 2 on CPU) with ``python -m
ddpkit.train.worker``. Run under a launcher (torchrun, srun, mpirun) it is one worker.
Options and the config file are checked here, before any process starts.
"""

from __future__ import annotations

import argparse
import json

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


def config_from_args(args: argparse.Namespace) -> Config:
    return resolve(vars(args), args.config)


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
    add_launch_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpkit.launch import launch
    from ddpkit.train import report
    from ddpkit.world import World

    cfg = config_from_args(args)
    if World.from_env(require_master_addr=False).source != "single":
        from ddpkit.train.worker import run_worker

        return run_worker(cfg)
    opts = options_from_args(args)
    check_world_size(cfg, opts)
    report.check_out_dir(cfg.train.out_dir)
    check_data(cfg)
    opts.module = True
    quiet_omp_warning(opts)
    return launch(WORKER_MODULE, ["--resolved-config", json.dumps(cfg.to_dict())], opts)
