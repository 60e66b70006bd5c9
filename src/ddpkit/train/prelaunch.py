"""Checks the launching command (``ddpkit train`` / ``ddpkit verify``) makes before any
worker starts: every worker would otherwise fail later, each with the same message.

They import torch only where a check needs it (the MNIST files, the ``net`` model's
input shape, an indivisible batch's message): the default ``ddpkit train`` launches
without importing torch at all.
"""

from __future__ import annotations

import os

from ddpkit.errors import ConfigError
from ddpkit.launcher.torchrun_args import cpu_only_torch, default_nproc
from ddpkit.slice_count import check_slices
from ddpkit.train import recipe
from ddpkit.train.config import Config


def check_world_size(cfg: Config, opts) -> None:
    """Catch a global batch the ranks cannot split (in exact mode: a world size that
    does not divide the slices)."""
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
    if cfg.train.batch_size < 1 or cfg.train.batch_size % (nproc * nnodes):
        from ddpkit.data.partition import local_batch_size

        local_batch_size(cfg.train.batch_size, nproc * nnodes)  # raises, in its words
    if cfg.train.exact:
        check_slices(cfg.slice_count(), cfg.train.batch_size, nproc * nnodes)


def check_launch(cfg: Config, opts) -> None:
    """What the agent or every worker would refuse only after the run directory exists
    and the workers started: checked before anything is made."""
    if opts.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
    if cfg.train.precision == "fp16":
        import_free = cpu_only_torch()  # a CPU-only build answers without importing torch
        if import_free or not _cuda_available():
            raise ConfigError("--precision fp16 needs CUDA (its GradScaler) and this machine "
                              "has no usable CUDA GPU: use --precision bf16")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_data(cfg: Config) -> None:
    """A model that does not fit the data, or a missing or malformed dataset; for the
    user's own factories (package.module:factory), that their modules are there."""
    for name, flag in ((cfg.data.name, "--data"), (cfg.model.name, "--model")):
        if recipe.is_factory(name):
            recipe.find_factory_module(name, flag)
    if recipe.is_factory(cfg.data.name) or recipe.is_factory(cfg.model.name):
        return  # shapes are known only once the workers build them
    if cfg.model.name == "net":  # the one built-in model that fits one input shape only
        from ddpkit.train.build import build_model
        from ddpkit.vocabulary import DATASETS

        spec = DATASETS.resolve(cfg.data.name, "--data")
        build_model(cfg.model, spec.input_shape, spec.num_classes)  # the run's own builder
    if cfg.data.name == "mnist":  # the only one read from the user's files
        from ddpkit.data.datasets import load_dataset

        load_dataset("mnist", cfg.data.data_dir)


def quiet_omp_warning(opts) -> None:
    """torchrun warns on every launch unless OMP_NUM_THREADS is set; set what the trainer
    would pick anyway (cores shared by the local processes)."""
    if "OMP_NUM_THREADS" not in os.environ:
        nproc = opts.nproc_per_node or default_nproc()
        opts.extra_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
