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

Every value is checked once, in :meth:`Config.validate`, so a bad value fails before
any process starts, as one line naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.slice_count import EXACT_THREADS, check_slices, default_slices
from ddpkit.train.names import COMM_CHOICES, DATASETS, ENGINES, MODELS, SHARD_CHOICES
from ddpkit.train.recipe import OPTIMIZERS, PRECISIONS, SCHEDULES, check_factory_spec

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


def flag_dest(name: str) -> str:
    """The argparse destination (and resolve() key) of a flag: ``--no-checkpoints`` ->
    ``checkpoints``, ``--batch-size`` -> ``batch_size``."""
    return name.lstrip("-").removeprefix("no-").replace("-", "_")


@dataclass
class DataConfig:
    name: str = flag("--data", f"dataset: {', '.join(DATASETS)}, or package.module:factory "
                     "returning (train, test) (default: digits)", default="digits",
                     metavar="NAME")
    data_dir: str | None = flag("--data-dir", "directory with the MNIST IDX files", default=None)
    synthetic_size: int = flag("--synthetic-size", "training samples of --data synthetic "
                               "(default: 8192)", default=8192, metavar="N")
    drop_last: bool = False  # False: pad the last global batch (padding never counted)


@dataclass
class ModelConfig:
    name: str = flag("--model", f"model: {', '.join(MODELS)}, or package.module:factory "
                     "returning your nn.Module (default: mlp)", default="mlp", metavar="NAME")
    hidden: list[int] = flag("--hidden", "MLP hidden layer widths (default: 128)",
                             default_factory=lambda: [128], metavar="H")


@dataclass
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


@dataclass
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


@dataclass
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


@dataclass
class FaultConfig:
    # Seconds any collective of the training loop may wait for the slowest rank before
    # the run fails naming the ranks that did not arrive. None: the process group's
    # default (10 minutes).
    collective_timeout: float | None = flag(
        "--collective-timeout", "fail, naming the ranks that did not arrive, when a collective "
        "waits longer than S seconds (default: 600)", default=None, group=RUN, metavar="S")


@dataclass
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
        cfg = cls()
        cfg.update(raw, source=source)
        return cfg

    def update(self, raw: dict[str, Any], *, source: str) -> None:
        """Overlay ``{section: {field: value}}`` onto this config, checking names and types."""
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
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
                setattr(target, key, _coerce(value, getattr(target, key), known[key],
                                             f"{source}: {section}.{key}"))

    # ------------------------------------------------------------- validation
    def validate(self) -> Config:
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{key} {msg}")

        d, m, o, t = self.data, self.model, self.optim, self.train
        check_factory_spec(d.name, "--data", DATASETS)
        if d.synthetic_size < 1:
            raise bad("data.synthetic_size", f"must be >= 1, got {d.synthetic_size}")
        check_factory_spec(m.name, "--model", MODELS)
        if not m.hidden or any(h < 1 for h in m.hidden):
            raise bad("--hidden", f"must be positive integers, got {m.hidden}")
        if not 0 < o.lr < math.inf:
            raise bad("--lr", f"must be > 0 and finite, got {o.lr}")
        if not 0 <= o.momentum < 1:
            raise bad("--momentum", f"must be in [0, 1), got {o.momentum}")
        if not 0 <= o.weight_decay < math.inf:
            raise bad("--weight-decay", f"must be >= 0 and finite, got {o.weight_decay}")
        if o.name not in OPTIMIZERS:
            raise bad("--optimizer", f"{o.name!r} is not one of {', '.join(OPTIMIZERS)}")
        if o.lr_schedule not in SCHEDULES:
            raise bad("--lr-schedule", f"{o.lr_schedule!r} is not one of {', '.join(SCHEDULES)}")
        if o.warmup_steps < 0:
            raise bad("--warmup-steps", f"must be >= 0, got {o.warmup_steps}")
        if o.clip_grad_norm is not None and not o.clip_grad_norm > 0:
            raise bad("--clip-grad-norm", f"must be > 0, got {o.clip_grad_norm}")
        if t.epochs < 1:
            raise bad("--epochs", f"must be >= 1, got {t.epochs}")
        if t.batch_size < 1:
            raise bad("--batch-size", f"must be >= 1, got {t.batch_size}")
        if t.grad_accum < 1:
            raise bad("--grad-accum", f"must be >= 1 (batches per optimizer step), got "
                                      f"{t.grad_accum}")
        if t.precision not in PRECISIONS:
            raise bad("--precision", f"{t.precision!r} is not one of {', '.join(PRECISIONS)}")
        if t.eval_batch_size < 1:
            raise bad("train.eval_batch_size", f"must be >= 1, got {t.eval_batch_size}")
        if t.seed < 0:
            raise bad("--seed", f"must be >= 0, got {t.seed}")
        if t.engine not in ENGINES:
            raise bad("--engine", f"{t.engine!r} is not one of {', '.join(ENGINES)}")
        if t.comm not in COMM_CHOICES:
            raise bad("--comm", f"{t.comm!r} is not one of {', '.join(COMM_CHOICES)}")
        if t.shard not in SHARD_CHOICES:
            raise bad("--shard", f"{t.shard!r} is not one of {', '.join(SHARD_CHOICES)}")
        if t.shard != "none" and t.engine != "ddpkit":
            raise bad("--shard", f"{t.shard!r} needs --engine ddpkit (torch's DDP does not "
                      "shard; torch's ZeroRedundancyOptimizer is the nearest)")
        if t.threads < 0:
            raise bad("train.threads", f"must be >= 0, got {t.threads}")
        if t.slices is not None and not t.exact:
            raise bad("--slices", "is exact mode's: add --exact")
        if t.exact:
            if t.engine != "ddpkit":
                raise bad("--exact", "is ddpkit's engine's: leave out --engine torch")
            if t.shard != "none":
                raise bad("--shard", f"{t.shard!r} does not combine with --exact (exact mode "
                          "sums whole gradients on every rank): leave out --shard")
            if t.grad_accum != 1:
                raise bad("--grad-accum", "does not combine with --exact: exact mode "
                          "accumulates over slices; use a --batch-size N times larger "
                          "and --slices (the same samples per step, summed exactly)")
            check_slices(self.slice_count(), t.batch_size, None)
        if not t.out_dir:
            raise bad("--out-dir", "must not be empty")
        if t.log_every_steps < 0:
            raise bad("--log-every-steps", f"must be >= 0, got {t.log_every_steps}")
        writers = [w.strip() for w in t.log_with.split(",") if w.strip()]
        unknown = [w for w in writers if w not in ("csv", "tensorboard")]
        if unknown:
            raise bad("--log-with", f"{unknown[0]!r} is not csv or tensorboard")
        if "tensorboard" in writers and importlib.util.find_spec("tensorboard") is None:
            raise bad("--log-with", "tensorboard needs the tensorboard package: "
                      "pip install 'ddpkit[tensorboard]' (or use csv)")
        c = self.checkpoint
        if c.every_steps is not None and c.every_steps < 1:
            raise bad("--checkpoint-every-steps", f"must be >= 1, got {c.every_steps}")
        if c.every_seconds is not None and not c.every_seconds > 0:
            raise bad("--checkpoint-every-seconds", f"must be > 0, got {c.every_seconds}")
        if c.keep < 1:
            raise bad("--keep", f"must be >= 1 (checkpoints kept), got {c.keep}")
        timeout = self.fault.collective_timeout
        if timeout is not None and not timeout > 0:
            raise bad("--collective-timeout", f"must be > 0 seconds, got {timeout}")
        return self

    def slice_count(self) -> int | None:
        """Exact mode's slices per step (the default for the batch when not given);
        None in the default mode."""
        t = self.train
        if not t.exact:
            return None
        return t.slices or default_slices(t.batch_size)

    def identity(self) -> dict[str, Any]:
        """The settings a checkpoint must agree with to be resumed under this config:
        what shapes the model, the optimizer state and the data order. Epochs, output,
        engine, threads, checkpoint and timeout settings may change on resume; in
        exact mode the slice count and the thread count may not (either changes the
        bits)."""
        d, t = self.data, self.train
        train: dict[str, Any] = {"seed": t.seed, "batch_size": t.batch_size,
                                 "grad_accum": t.grad_accum}
        if t.exact:
            train.update(exact=True, slices=self.slice_count(),
                         threads=t.threads or EXACT_THREADS)
        return {
            "data": {"name": d.name, "synthetic_size": d.synthetic_size,
                     "drop_last": d.drop_last},
            "model": dataclasses.asdict(self.model),
            "optim": dataclasses.asdict(self.optim),
            "train": train,
        }


def _coerce(value: Any, current: Any, f: dataclasses.Field, key: str) -> Any:
    """Check a file/CLI value against the field's type (bool is not an int here)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{key} must not be empty")
    if kind.startswith("list"):
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{key} must be a list of integers, got {value!r}")
        return list(value)
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    return value


# Keys that were renamed: a config file or a run's saved settings that use the old name
# still load (section, old key) -> new key.
RENAMED_KEYS = {("train", "virtual_shards"): "slices"}


def with_current_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` (``{section: {key: value}}``) with renamed keys under their current names."""
    out: dict[str, Any] = {}
    for section, values in raw.items():
        if isinstance(values, Mapping):
            values = {RENAMED_KEYS.get((section, k), k): v for k, v in values.items()}
        out[section] = values
    return out


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(
                "reading --config needs Python >= 3.11 or `pip install tomli`"
            ) from None
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                          f"at offset {exc.start}); TOML files are UTF-8: save it as UTF-8")\
            from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None


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
    the command line, in that order; validated."""
    cfg = Config()
    if base is not None:
        cfg.update(base, source=base_source)
    if config_file is not None:
        cfg.update(read_toml(config_file), source=f"--config {config_file}")
    overrides: dict[str, dict[str, Any]] = {}
    # Flags left unset on the command line are None: they do not override the file.
    for section, f in flag_fields():
        value = cli.get(flag_dest(f.metadata["flag"]))
        if value is not None:
            overrides.setdefault(section, {})[f.name] = value
    cfg.update(overrides, source="command line")
    return cfg.validate()
