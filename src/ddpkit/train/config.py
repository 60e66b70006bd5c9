"""Training configuration: one dataclass per concern, one documented precedence.

    command line  >  TOML file (--config)  >  dataclass defaults

A TOML file has one table per concern, with the dataclasses' field names::

    [data]
    name = "digits"          # digits | mnist | synthetic
    [model]
    name = "mlp"
    hidden = [128]
    [optim]
    lr = 0.1
    [train]
    epochs = 20
    batch_size = 128         # global: split over the ranks
    [checkpoint]
    every_steps = 50         # also at every epoch's end
    keep = 3
    [fault]
    collective_timeout = 300 # seconds

Every section is a frozen dataclass that checks its values where it is built
(``__post_init__``): an invalid config cannot exist, so a bad value fails before any
process starts, as one line naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.slice_count import EXACT_THREADS, check_slices, default_slices
from ddpkit.train.config_values import coerce, read_toml, with_current_keys
from ddpkit.train.recipe import check_factory_spec
from ddpkit.vocabulary import (
    COMM_CHOICES,
    DATASETS,
    ENGINES,
    MODELS,
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULES,
    SHARD_CHOICES,
)

# Command-line groups a flag can belong to (`ddpkit verify` takes only TRAINING).
TRAINING = "training (command line > --config file > defaults)"
RUN = "checkpoints and fault tolerance (docs/checkpoints.md)"


def flag(name: str, help: str, *, default: Any = dataclasses.MISSING,
         default_factory: Any = dataclasses.MISSING, group: str = TRAINING,
         **argparse_kwargs: Any) -> Any:
    """A config field that is also a command-line flag: the flag, its help and its
    group live on the field, so an option is one field (train/options.py derives the
    argparse flag, and resolve() the override). A bool field's flag sets the opposite
    of its default (``--no-progress``, ``--log-sample-ids``)."""
    meta = {"flag": name, "help": help, "group": group, "argparse": argparse_kwargs}
    return field(default=default, default_factory=default_factory, metadata=meta)


def _bad(key: str, msg: str) -> ConfigError:
    return ConfigError(f"{key} {msg}")


def _one_of(flag_name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _bad(flag_name, f"{value!r} is not one of {', '.join(allowed)}")


def flag_dest(name: str) -> str:
    """The argparse destination (and resolve() key) of a flag: ``--no-checkpoints`` ->
    ``checkpoints``, ``--batch-size`` -> ``batch_size``."""
    return name.lstrip("-").removeprefix("no-").replace("-", "_")


@dataclass(frozen=True)
class DataConfig:
    name: str = flag("--data", f"dataset: {', '.join(DATASETS)}, or package.module:factory "
                     "returning (train, test) (default: digits)", default="digits",
                     metavar="NAME")
    data_dir: str | None = flag("--data-dir", "directory with the MNIST IDX files", default=None)
    synthetic_size: int = flag("--synthetic-size", "training samples of --data synthetic "
                               "(default: 8192)", default=8192, metavar="N")
    drop_last: bool = False  # False: pad the last global batch (padding never counted)

    def __post_init__(self) -> None:
        check_factory_spec(self.name, "--data", DATASETS)
        if self.synthetic_size < 1:
            raise _bad("data.synthetic_size", f"must be >= 1, got {self.synthetic_size}")


@dataclass(frozen=True)
class ModelConfig:
    name: str = flag("--model", f"model: {', '.join(MODELS)}, or package.module:factory "
                     "returning your nn.Module (default: mlp)", default="mlp", metavar="NAME")
    hidden: list[int] = flag("--hidden", "MLP hidden layer widths (default: 128)",
                             default_factory=lambda: [128], metavar="H")

    def __post_init__(self) -> None:
        check_factory_spec(self.name, "--model", MODELS)
        if not self.hidden or any(h < 1 for h in self.hidden):
            raise _bad("--hidden", f"must be positive integers, got {self.hidden}")


@dataclass(frozen=True)
class OptimConfig:
    # SGD with momentum. Defaults above the tutorial's lr=0.01, momentum=0.5: on digits that
    # pair is far from converged after the default 20 epochs.
    name: str = flag("--optimizer", "sgd (with --momentum) or adamw (default: sgd)",
                     default="sgd", choices=OPTIMIZERS)
    lr: float = flag("--lr", "peak learning rate (default: 0.1; adamw usually wants ~0.001)",
                     default=0.1)
    momentum: float = flag("--momentum", "SGD momentum (default: 0.9)", default=0.9)
    weight_decay: float = flag("--weight-decay", "weight decay (adamw: decoupled; default: 0)",
                               default=0.0)
    lr_schedule: str = flag("--lr-schedule", "constant, or cosine decay to 0 at the last "
                            "step (default: constant)", default="constant", choices=SCHEDULES)
    warmup_steps: int = flag("--warmup-steps", "linear learning-rate warm-up over the first N "
                             "optimizer steps (default: 0)", default=0, metavar="N")
    clip_grad_norm: float | None = flag("--clip-grad-norm", "clip the total gradient 2-norm "
                                        "to X before each step", default=None, metavar="X")

    def __post_init__(self) -> None:
        if not 0 < self.lr < math.inf:
            raise _bad("--lr", f"must be > 0 and finite, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise _bad("--momentum", f"must be in [0, 1), got {self.momentum}")
        if not 0 <= self.weight_decay < math.inf:
            raise _bad("--weight-decay", f"must be >= 0 and finite, got {self.weight_decay}")
        _one_of("--optimizer", self.name, OPTIMIZERS)
        _one_of("--lr-schedule", self.lr_schedule, SCHEDULES)
        if self.warmup_steps < 0:
            raise _bad("--warmup-steps", f"must be >= 0, got {self.warmup_steps}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise _bad("--clip-grad-norm", f"must be > 0, got {self.clip_grad_norm}")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = flag("--epochs", "epochs (default: 20)", default=20)
    # Global batch: each of W ranks reads batch_size // W per step.
    batch_size: int = flag("--batch-size", "GLOBAL batch size, split evenly over all ranks "
                           "(default: 128)", default=128)
    eval_batch_size: int = 1024  # global, for the test pass
    grad_accum: int = flag("--grad-accum", "optimizer step every N global batches "
                           "(gradients accumulated: N x --batch-size samples per step)",
                           default=1, metavar="N")
    precision: str = flag("--precision", "fp32, bf16 (autocast) or fp16 (autocast and "
                          "GradScaler; CUDA only) (default: fp32)", default="fp32",
                          choices=PRECISIONS)
    seed: int = flag("--seed", "seed for weights and data order", default=1234)
    engine: str = flag("--engine", "data-parallel engine: ddpkit's DataParallel or torch's "
                       "DDP", default="ddpkit", choices=ENGINES)
    comm: str = flag("--comm", "how gradient buckets are all-reduced: auto (shared memory "
                     "for CPU ranks on one host, the backend otherwise), backend, ring or shm "
                     "(default: auto)", default="auto", metavar="COMM")
    shard: str = flag("--shard", "ZeRO sharding: none, optimizer (optimizer state split across "
                      "ranks), gradients (and gradients too) or parameters (and the weights "
                      "too) (default: none)",
                      default="none", choices=SHARD_CHOICES)
    # Exact mode: the same bits at any world size (docs/exact.md).
    exact: bool = flag("--exact", "the same bits at any world size and across a resume at "
                       "another one: each step runs as slices with their own random "
                       "streams, summed exactly (docs/exact.md)", default=False)
    slices: int | None = flag(
        "--slices", "exact mode's slices per step: a divisor of --batch-size; the "
        "run can use the world sizes that divide it (default: of the divisors up to 12, "
        "the one most world sizes divide, e.g. 12 for a batch of 96)", default=None,
        metavar="N")
    out_dir: str = flag("--out-dir", "parent of the new run directory (default: runs/)",
                        default="runs")
    progress: bool = flag("--no-progress", "no progress bar", default=True)
    # torch threads per process; 0: cores shared evenly by the local ranks.
    threads: int = flag("--threads", "torch threads per process (default: cores / local "
                        "processes; 1 with --exact)", default=0)
    # Per-rank JSONL of the sample ids each step trained on.
    log_sample_ids: bool = flag(
        "--log-sample-ids", "write the sample ids of every step, per rank, to <run dir>/"
        "sample_ids/ (to audit that none is lost or repeated)", default=False, group=RUN)
    # Per-step records in metrics.jsonl besides the epoch records (ddpkit.Run's writers).
    log_every_steps: int = flag(
        "--log-every-steps", "also write the step's train loss and learning rate to "
        "metrics.jsonl every N optimizer steps (default: 0, epoch records only)", default=0,
        metavar="N", group=RUN)
    log_with: str = flag(
        "--log-with", "also write the records to csv (metrics.csv) and/or tensorboard (tb/, "
        "needs pip install 'ddpkit[tensorboard]'), comma-separated", default="",
        metavar="csv,tensorboard", group=RUN)

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise _bad("--epochs", f"must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise _bad("--batch-size", f"must be >= 1, got {self.batch_size}")
        if self.grad_accum < 1:
            raise _bad("--grad-accum", f"must be >= 1 (batches per optimizer step), got "
                                       f"{self.grad_accum}")
        _one_of("--precision", self.precision, PRECISIONS)
        if self.eval_batch_size < 1:
            raise _bad("train.eval_batch_size", f"must be >= 1, got {self.eval_batch_size}")
        if self.seed < 0:
            raise _bad("--seed", f"must be >= 0, got {self.seed}")
        _one_of("--engine", self.engine, ENGINES)
        _one_of("--comm", self.comm, COMM_CHOICES)
        _one_of("--shard", self.shard, SHARD_CHOICES)
        if self.shard != "none" and self.engine != "ddpkit":
            raise _bad("--shard", f"{self.shard!r} needs --engine ddpkit (torch's DDP does not "
                       "shard; torch's ZeroRedundancyOptimizer is the nearest)")
        if self.threads < 0:
            raise _bad("train.threads", f"must be >= 0, got {self.threads}")
        if self.slices is not None and not self.exact:
            raise _bad("--slices", "is exact mode's: add --exact")
        if self.exact:
            self._check_exact()
        if not self.out_dir:
            raise _bad("--out-dir", "must not be empty")
        if self.log_every_steps < 0:
            raise _bad("--log-every-steps", f"must be >= 0, got {self.log_every_steps}")
        writers = [w.strip() for w in self.log_with.split(",") if w.strip()]
        unknown = [w for w in writers if w not in ("csv", "tensorboard")]
        if unknown:
            raise _bad("--log-with", f"{unknown[0]!r} is not csv or tensorboard")
        if "tensorboard" in writers and importlib.util.find_spec("tensorboard") is None:
            raise _bad("--log-with", "tensorboard needs the tensorboard package: "
                       "pip install 'ddpkit[tensorboard]' (or use csv)")

    def _check_exact(self) -> None:
        if self.engine != "ddpkit":
            raise _bad("--exact", "is ddpkit's engine's: leave out --engine torch")
        if self.shard != "none":
            raise _bad("--shard", f"{self.shard!r} does not combine with --exact (exact mode "
                       "sums whole gradients on every rank): leave out --shard")
        if self.grad_accum != 1:
            raise _bad("--grad-accum", "does not combine with --exact: exact mode "
                       "accumulates over slices; use a --batch-size N times larger "
                       "and --slices (the same samples per step, summed exactly)")
        check_slices(self.slice_count(), self.batch_size, None)

    def thread_count(self, local_processes: int) -> int:
        """Torch intra-op threads per process, the one place they are decided:
        ``--threads``; else in exact mode the same count at every layout; else the
        host's cores shared by its ``local_processes`` (oversubscribing them makes
        every rank slower)."""
        if self.threads:
            return self.threads
        if self.exact:
            return EXACT_THREADS
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count())
        return max(1, (cores or 1) // local_processes)

    def slice_count(self) -> int | None:
        """Exact mode's slices per step (the default for the batch when not given);
        None in the default mode. The one place a run's slice count is decided."""
        if not self.exact:
            return None
        return self.slices or default_slices(self.batch_size)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints go to ``<run dir>/checkpoints``; one is written at every epoch's end
    and, between epochs, every ``every_steps`` steps and/or ``every_seconds`` seconds."""

    enabled: bool = flag("--no-checkpoints", "write no checkpoints (such a run cannot be "
                         "resumed)", default=True, group=RUN)
    every_steps: int | None = flag("--checkpoint-every-steps", "also checkpoint every N steps "
                                   "(always: at every epoch's end)", default=None, group=RUN,
                                   metavar="N")
    every_seconds: float | None = flag(
        "--checkpoint-every-seconds", "also checkpoint when S seconds passed since the last "
        "one", default=None, group=RUN, metavar="S")
    # Newest checkpoints kept; the newest good one is never deleted.
    keep: int = flag("--keep", "checkpoints kept (default: 3)", default=3, group=RUN,
                     metavar="K")
    init_from: str | None = flag(
        "--init-from", "start a new run from the model (and optimizer state) of this "
        "torch.distributed.checkpoint directory: torch DDP, FSDP2, torchtitan or ddpkit",
        default=None, group=RUN, metavar="DIR")

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise _bad("--checkpoint-every-steps", f"must be >= 1, got {self.every_steps}")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise _bad("--checkpoint-every-seconds", f"must be > 0, got {self.every_seconds}")
        if self.keep < 1:
            raise _bad("--keep", f"must be >= 1 (checkpoints kept), got {self.keep}")


@dataclass(frozen=True)
class FaultConfig:
    # Seconds any collective of the training loop may wait for the slowest rank before
    # the run fails naming the ranks that did not arrive. None: the process group's
    # default (10 minutes).
    collective_timeout: float | None = flag(
        "--collective-timeout", "fail, naming the ranks that did not arrive, when a collective "
        "waits longer than S seconds (default: 600)", default=None, group=RUN, metavar="S")

    def __post_init__(self) -> None:
        timeout = self.collective_timeout
        if timeout is not None and not timeout > 0:
            raise _bad("--collective-timeout", f"must be > 0 seconds, got {timeout}")


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    # ------------------------------------------------------------- (de)serialize
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> Config:
        return cls().replaced((raw, source))

    def replaced(self, *layers: tuple[Mapping[str, Any], str]) -> Config:
        """This config with each ``({section: {field: value}}, source)`` overlaid in
        turn, names and types checked per source; each section touched is built (and
        so checked) once, from all the layers: a value one layer needs may come from
        a later one."""
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        merged: dict[str, dict[str, Any]] = {}
        for raw, source in layers:
            for section, values in with_current_keys(raw).items():
                if section not in sections:
                    raise ConfigError(
                        f"{source}: unknown section [{section}]; known: {', '.join(sections)}"
                    )
                if not isinstance(values, dict):
                    raise ConfigError(f"{source}: [{section}] must be a table of key = value")
                target = sections[section]
                known = {f.name: f for f in dataclasses.fields(target)}
                for key, value in values.items():
                    if key not in known:
                        raise ConfigError(
                            f"{source}: unknown key {section}.{key}; known: {', '.join(known)}"
                        )
                    merged.setdefault(section, {})[key] = coerce(
                        value, getattr(target, key), known[key], f"{source}: {section}.{key}")
        changed = {name: dataclasses.replace(sections[name], **values)
                   for name, values in merged.items()}
        return dataclasses.replace(self, **changed) if changed else self

    def slice_count(self) -> int | None:
        """Exact mode's slices per step (see :meth:`TrainConfig.slice_count`)."""
        return self.train.slice_count()

    def identity(self) -> dict[str, Any]:
        """The settings a checkpoint must agree with to be resumed under this config:
        what shapes the model, the optimizer state and the data order. Epochs, output,
        engine, threads, checkpoint and timeout settings may change on resume; in
        exact mode neither may the slice count, the thread count, the precision, nor
        (with a learning-rate schedule that runs to the last step) the epochs: each
        changes the bits, which exact mode promises to keep."""
        d, t = self.data, self.train
        train: dict[str, Any] = {"seed": t.seed, "batch_size": t.batch_size,
                                 "grad_accum": t.grad_accum}
        if t.exact:
            train.update(exact=True, slices=self.slice_count(), threads=t.thread_count(1),
                         precision=t.precision)
            if self.optim.lr_schedule != "constant":
                train["epochs"] = t.epochs
        return {
            "data": {"name": d.name, "synthetic_size": d.synthetic_size,
                     "drop_last": d.drop_last},
            "model": dataclasses.asdict(self.model),
            "optim": dataclasses.asdict(self.optim),
            "train": train,
        }


def flag_fields() -> list[tuple[str, dataclasses.Field]]:
    """Every ``(section, field)`` of the config that has a command-line flag."""
    sections = dataclasses.fields(Config)
    return [(s.name, f) for s in sections for f in dataclasses.fields(s.default_factory)
            if "flag" in f.metadata]


def resolve(
    cli: dict[str, Any],
    config_file: str | os.PathLike | None = None,
    *,
    base: dict[str, Any] | None = None,
    base_source: str = "saved run config",
) -> Config:
    """Defaults, overlaid by ``base`` (a resumed run's own config), the TOML file and
    the command line, in that order; checked once, as the config is built."""
    layers: list[tuple[Mapping[str, Any], str]] = []
    if base is not None:
        layers.append((base, base_source))
    if config_file is not None:
        layers.append((read_toml(config_file), f"--config {config_file}"))
    overrides: dict[str, dict[str, Any]] = {}
    # Flags left unset on the command line are None: they do not override the file.
    for section, f in flag_fields():
        value = cli.get(flag_dest(f.metadata["flag"]))
        if value is not None:
            overrides.setdefault(section, {})[f.name] = value
    layers.append((overrides, "command line"))
    return Config().replaced(*layers)
