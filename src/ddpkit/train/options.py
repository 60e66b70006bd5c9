"""Command-line options of the training application, shared by ``ddpkit train``,
``ddpkit verify`` and the worker processes they start.

The training flags come from the config's fields (:func:`ddpkit.train.config.flag`), so
a new option is one field in train/config.py plus its use. Every flag defaults to None,
"not given", which is how precedence (command line > --config file > defaults) knows
what to override.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ddpkit.train.config import RUN, TRAINING, Config, flag_dest, flag_fields, resolve
from ddpkit.train.resume import LATEST, read_run_config

_SCALARS = {"int": int, "float": float, "str": str}


def _default_text(f: dataclasses.Field) -> str:
    factory = f.default_factory
    value = factory() if factory is not dataclasses.MISSING else f.default
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "none" if value is None else str(value)


def _add_field_flag(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    meta = f.metadata
    text = meta["help"]
    kind = f.type if isinstance(f.type, str) else str(f.type)
    if "default" not in text and not kind.startswith("bool"):
        # The flag itself defaults to None ("not given": precedence needs it), so the
        # help says the field's default.
        text = f"{text} (default: {_default_text(f)})"
    kwargs = dict(meta["argparse"], dest=flag_dest(meta["flag"]), default=None, help=text)
    if kind.startswith("bool"):
        # The flag turns the default over: --no-progress stores False.
        kwargs.update(action="store_const", const=not f.default)
    elif kind.startswith("list"):
        kwargs.update(type=int, nargs="+")
    else:
        kwargs["type"] = _SCALARS[kind.split(" ")[0]]
    group.add_argument(meta["flag"], **kwargs)


def _add_flags(p: argparse.ArgumentParser, title: str,
               exclude: tuple[str, ...] = ()) -> argparse._ArgumentGroup:
    g = p.add_argument_group(title)
    for _section, f in flag_fields():
        if f.metadata["group"] == title and f.metadata["flag"] not in exclude:
            _add_field_flag(g, f)
    return g


# What `ddpkit verify` does not take, and why: it takes --steps steps, writes no run
# directory, draws no progress, and its one-process reference takes plain optimizer
# steps (train/equivalence.py's check_plain_steps, which a --config file still meets).
NOT_FOR_VERIFY = {
    "--epochs": "verify takes --steps steps",
    "--out-dir": "verify writes no run directory",
    "--no-progress": "verify draws no progress bar",
    **dict.fromkeys(("--lr-schedule", "--warmup-steps", "--clip-grad-norm", "--grad-accum",
                     "--precision"),
                    "verify compares plain fp32 optimizer steps at a constant learning rate "
                    "with one process; leave it out"),
}


def add_train_options(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """What shapes the training: data, model, optimizer, epochs, engine, output (less the
    flags in ``exclude``)."""
    g = _add_flags(p, TRAINING, exclude)
    g.add_argument("--config", metavar="FILE.toml", default=None,
                   help="TOML file with [data] [model] [optim] [train] tables "
                        "(default: none)")


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Checkpoint, resume and fault-tolerance options of `train` and its worker."""
    g = _add_flags(p, RUN)
    g.add_argument("--resume", nargs="?", const=LATEST, default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest good checkpoint, with its own "
                        "settings (options given here override them); without RUN_DIR: "
                        "the most recently checkpointed run under --out-dir (default: start "
                        "a new run)")
    g.add_argument("--run-dir", default=None, metavar="DIR",
                   help="write this run into DIR (new or empty) instead of a new directory "
                        "under --out-dir; multi-node runs with --max-restarts need it "
                        "(default: a new directory under --out-dir)")


def add_verify_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("verify")
    g.add_argument("--steps", type=int, default=10, help="training steps to compare (default: 10)")
    g.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="parameter dtype; the tolerance scales with its epsilon "
                        "(default: float32)")


def add_resolved_config(p: argparse.ArgumentParser) -> None:
    """The launching command passes its already resolved config to the workers."""
    p.add_argument("--resolved-config", default=None, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace, resume_dir: Path | None = None) -> Config:
    """Defaults < the resumed run's own config < --config file < command line; or the
    config the launching command resolved, as it is."""
    resolved = getattr(args, "resolved_config", None)
    if resolved is not None:
        return Config.from_dict(json.loads(resolved), source="launching command")
    base = read_run_config(resume_dir) if resume_dir is not None else None
    return resolve(vars(args), args.config, base=base, base_source=f"{resume_dir}/config.json")


__all__ = ["add_train_options", "add_run_options", "add_verify_options",
           "add_resolved_config", "config_from_args"]
