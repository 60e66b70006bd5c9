"""One builder: a :class:`Config` becomes a run's parts here, and only here.

:func:`build_parts` makes, in this order, the data, the model (the same initial
weights on every rank), the engine around it, the optimizer, the precision, the
samplers and the step count, with the slice count (exact mode) and the intra-op
thread count the config decides (:meth:`TrainConfig.slice_count`,
:meth:`TrainConfig.thread_count`), each settled once here for the whole run. The
trainer trains the parts it returns; ``ddpkit verify`` builds its one-process
references with it (``engine=False``, a world of one); the launching command's
pre-flight check builds the model alone with :func:`build_model` (no data, no torch
until a check needs it).

The per-step helpers (learning rate, accumulation, precision) live in
:mod:`ddpkit.train.recipe`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ddpkit.data.datasets import ArrayDataset, load_dataset
from ddpkit.data.partition import ShardSampler
from ddpkit.errors import ConfigError
from ddpkit.parallel import data_parallel
from ddpkit.runtime.world import World
from ddpkit.train import recipe
from ddpkit.train.config import Config
from ddpkit.train.models import builtin_model
from ddpkit.vocabulary import OPTIMIZERS

# A user's own wrapper in place of the engine: ``wrap(module, engine_name, device)``.
Wrap = Callable[[nn.Module, str, torch.device], nn.Module]


@dataclass(frozen=True)
class Parts:
    """What a run trains: built by :func:`build_parts`, never changed afterwards."""

    train_set: ArrayDataset
    test_set: ArrayDataset
    module: nn.Module  # the plain model (the engine's ``.module``)
    model: nn.Module  # what the loop calls: the engine around ``module``, or ``module``
    engine: str  # what runs: "ddpkit", "torch" (also a custom wrap's), or "none"
    sharded: bool  # ZeRO: the optimizer holds this rank's pieces of the weights
    optimizer: torch.optim.Optimizer
    precision: recipe.Precision
    sampler: ShardSampler  # the training data's, in global batches
    test_sampler: ShardSampler
    total_steps: int  # optimizer steps of the whole run
    slices: int | None  # exact mode's slices per step; None in the default mode
    threads: int  # torch intra-op threads of this process
    device: torch.device


def build_parts(cfg: Config, world: World, *,
                datasets: tuple[ArrayDataset, ArrayDataset] | None = None,
                wrap: Wrap | None = None, engine: bool = True,
                threads: int | None = None) -> Parts:
    """The parts of a run of ``cfg`` on this rank of ``world``.

    ``datasets``: ``(train, test)`` instead of loading ``cfg.data``. ``wrap``: a
    wrapper instead of the configured engine. ``engine=False``: no engine (one
    process, plain PyTorch). ``threads``: keep this thread count instead of
    deciding it (a reference run in the same process as the run it checks).
    """
    t = cfg.train
    threads = t.thread_count(world.local_world_size) if threads is None else threads
    slices = cfg.slice_count()
    device = torch.device(world.device)
    # The run's threads from the start (the data and the model are built under them).
    torch.set_num_threads(threads)
    train_set, test_set = datasets or load_data(cfg.data)
    train_set, test_set = _to_device(train_set, device), _to_device(test_set, device)

    torch.manual_seed(t.seed)  # same initial weights on every rank (and vs. 1 process)
    module = build_model(cfg.model, train_set.input_shape, train_set.num_classes).to(device)
    model, runs = module, "none"
    if engine:
        # The model is already on its device and so are the batches, so neither engine
        # needs device_ids (torch DDP infers a single-device module's device).
        exact = {"exact": True, "slices": slices} if t.exact else {}
        model = (wrap(module, t.engine, device) if wrap is not None
                 else data_parallel(module, engine=t.engine, comm=t.comm, **exact,
                                    **({} if t.shard == "none" else {"shard": t.shard})))
        # What actually runs: a custom ``wrap`` may not use the engine requested.
        runs = "torch" if type(model).__module__.startswith("torch.") else t.engine
        if torch.get_num_threads() != threads:  # exact mode's engine pins its own count
            torch.set_num_threads(threads)  # what the run asked for wins
    # Dropout masks should differ between ranks but still follow from the seed. (In
    # exact mode they follow the slice; nothing random is left per rank.)
    torch.manual_seed(t.seed + 1 + (0 if t.exact else world.rank))
    sharded = getattr(model, "shard", "none") != "none"
    optimizer = build_optimizer((model if sharded else module).parameters(), cfg.optim)
    sampler = ShardSampler(train_set, global_batch_size=t.batch_size,
                           num_replicas=world.world_size, rank=world.rank, seed=t.seed,
                           drop_last=cfg.data.drop_last, slices=slices)
    eval_batch = math.ceil(t.eval_batch_size / world.world_size) * world.world_size
    test_sampler = ShardSampler(test_set, global_batch_size=eval_batch,
                                num_replicas=world.world_size, rank=world.rank, shuffle=False)
    total_steps = t.epochs * recipe.steps_per_epoch(len(train_set), t.batch_size,
                                                    t.grad_accum, cfg.data.drop_last)
    return Parts(train_set=train_set, test_set=test_set, module=module, model=model,
                 engine=runs, sharded=sharded, optimizer=optimizer,
                 precision=recipe.Precision(t.precision, device), sampler=sampler,
                 test_sampler=test_sampler, total_steps=total_steps, slices=slices,
                 threads=threads, device=device)


# --------------------------------------------------------------------------- the pieces
def build_model(model_cfg, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """A fresh model: a built-in by name, or the user's ``factory(input_shape=...,
    num_classes=..., hidden=...)`` (called with those of the keywords it takes). Like the
    built-ins it must return log-probabilities (the loss is ``nll_loss``)."""
    name = model_cfg.name
    if not recipe.is_factory(name):
        return builtin_model(name, input_shape, num_classes, hidden=model_cfg.hidden)
    factory = recipe.load_factory(name, "--model")
    model = recipe.call_with(factory, {"input_shape": tuple(input_shape),
                                       "num_classes": num_classes,
                                       "hidden": list(model_cfg.hidden)}, f"--model {name}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {name} returned {type(model).__name__}, not a "
                          "torch.nn.Module")
    return model


def load_data(data_cfg) -> tuple[ArrayDataset, ArrayDataset]:
    """``(train, test)`` ArrayDatasets: a built-in by name, or the user's ``factory()``
    returning ``(train, test)``, each an ArrayDataset or a pair ``(inputs, labels)`` of
    tensors (labels 0..C-1; C is taken from both splits' labels)."""
    name = data_cfg.name
    if not recipe.is_factory(name):
        return load_dataset(name, data_cfg.data_dir, synthetic_size=data_cfg.synthetic_size)
    factory = recipe.load_factory(name, "--data")
    made = recipe.call_with(factory, {"data_dir": data_cfg.data_dir}, f"--data {name}")
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise ConfigError(f"--data {name} must return (train, test), got {type(made).__name__}")
    pairs = []
    for split, part in zip(("train", "test"), made, strict=True):
        if isinstance(part, ArrayDataset):
            pairs.append((part.x, part.y))
            continue
        if not (isinstance(part, (tuple, list)) and len(part) == 2
                and all(isinstance(t, torch.Tensor) for t in part)):
            raise ConfigError(f"--data {name}: the {split} split must be an ArrayDataset or "
                              "(inputs, labels) tensors")
        pairs.append((part[0], part[1]))
    classes = 1 + max(int(y.max()) for _, y in pairs if len(y))
    tag = recipe.short_name(name)
    train, test = (ArrayDataset(x.float(), y.long(), classes, tag) for x, y in pairs)
    return train, test


def build_optimizer(params, optim_cfg) -> torch.optim.Optimizer:
    """The optimizer :data:`ddpkit.vocabulary.OPTIMIZERS` names ``optim_cfg.name``."""
    return OPTIMIZERS.resolve(optim_cfg.name, "--optimizer")(params, optim_cfg)


def _to_device(ds: ArrayDataset, device: torch.device) -> ArrayDataset:
    if device.type == "cpu":
        return ds
    # Small in-memory datasets: move once, not every batch.
    return ArrayDataset(ds.x.to(device), ds.y.to(device), ds.num_classes, ds.name)


__all__ = ["Parts", "Wrap", "build_model", "build_optimizer", "build_parts",
           "load_data"]

