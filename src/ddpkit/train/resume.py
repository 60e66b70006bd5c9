"""The launcher's side of resuming: which run, whether it can be resumed, how it ended.

``ddpkit train`` answers these before any worker starts (a mistake is one line and
nothing in the run directory changes) and after the workers exit (a preempted run
exits with :data:`~ddpkit.fault.EXIT_PREEMPTED` and says how to continue). The
workers check again for themselves (:meth:`Trainer.restore`), so a worker started
by another launcher is just as safe.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.errors import ConfigError
from ddpkit.files.run_lock import LOCK_FILE
from ddpkit.train import report
from ddpkit.train.config import Config
from ddpkit.train.config_values import with_current_keys
from ddpkit.train.report import CHECKPOINT_DIR

if TYPE_CHECKING:  # ddpkit.checkpoint imports torch: the launcher needs it only to resume
    from ddpkit.checkpoint import Checkpointer, CheckpointInfo

LATEST = ""  # `--resume` given without a directory: the newest run under --out-dir
# Settings that joined a run's identity (Config.identity) after checkpoints were
# written without them.
IDENTITY_ADDED = (("train", "precision"), ("train", "epochs"))


def _checkpoints(run_dir: Path) -> Checkpointer:
    from ddpkit.checkpoint import Checkpointer

    return Checkpointer(run_dir / CHECKPOINT_DIR, keep=None, create=False)


def find_run_dir(resume: str, out_dir: str | os.PathLike) -> Path:
    """The run directory ``--resume`` means: the given one (a run directory or its
    ``checkpoints`` folder), or with no value the run under ``out_dir`` whose newest
    checkpoint is the most recent."""
    if resume != LATEST:
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"--resume {path}: no such directory; give a run directory "
                              f"(e.g. runs/<name>) or --resume alone for the newest run")
        if path.name == CHECKPOINT_DIR and not (path / CHECKPOINT_DIR).exists():
            path = path.parent
        return path
    out = Path(out_dir)
    newest: tuple[float, Path] | None = None
    if out.is_dir():
        for run in out.iterdir():
            if not (run / CHECKPOINT_DIR).is_dir():
                continue
            for info in _checkpoints(run).checkpoints():
                if newest is None or info.saved_at > newest[0]:
                    newest = (info.saved_at, run)
    if newest is None:
        raise ConfigError(f"--resume: no run with checkpoints under {out}; "
                          "give the run directory: --resume runs/<name>")
    return newest[1]


def run_to_continue(run_dir: Path) -> Path | None:
    """What ``--run-dir R`` means: None to start a new run in R (missing or empty), R
    itself when it holds a run that stopped before its end (a scheduler reruns the same
    command line after a preemption: it continues), else one clear error."""
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a directory; give the path "
                          "of a new directory (or of a run to continue)")
    if not any(p.is_file() and p.name != LOCK_FILE for p in run_dir.rglob("*")):
        return None  # nothing written yet (a start that failed early leaves empty folders)
    if not (run_dir / report.CONFIG_FILE).is_file():
        raise ConfigError(f"--run-dir {run_dir} already exists and holds files that are not a "
                          "run of ddpkit train; choose a new directory")
    if (run_dir / report.SUMMARY_FILE).exists():
        raise ConfigError(f"--run-dir {run_dir} holds a finished run (its "
                          f"{report.SUMMARY_FILE} is there); choose a new directory to train "
                          "again")
    if not _checkpoints(run_dir).checkpoints():
        raise ConfigError(f"--run-dir {run_dir} holds a run that stopped before its first "
                          "checkpoint, so there is nothing to continue; remove it or choose a "
                          "new directory")
    return run_dir


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The resumed run's own settings (its ``config.json``), the base under the
    ``--config`` file and the command line."""
    path = run_dir / report.CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--resume {run_dir}: no {report.CONFIG_FILE}; "
                          "is it a run directory of ddpkit train?") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--resume {run_dir}: cannot read {path.name} ({err})") from None
    return {k: v for k, v in raw.items() if isinstance(v, dict)}  # drop world_size etc.


def check_resumable(run_dir: Path, cfg: Config) -> CheckpointInfo:
    """The checkpoint a resume will start from, or one clear error; reads only."""
    from ddpkit.checkpoint import CheckpointError

    ckpt = _checkpoints(run_dir)
    if not ckpt.checkpoints():
        raise CheckpointError(
            f"--resume {run_dir}: no checkpoint in {ckpt.dir} (the run was started with "
            "--no-checkpoints, or stopped before its first checkpoint); nothing to resume"
        )
    info = ckpt.latest()  # warns about each damaged checkpoint it skips
    if info is None:
        raise CheckpointError(
            f"--resume {run_dir}: every checkpoint in {ckpt.dir} is damaged (see the "
            "warnings above); nothing to resume"
        )
    saved = info.meta.get("config")
    if saved is not None:
        refuse_changed_config(saved, cfg, f"--resume {run_dir}: its checkpoint {info.name}")
    return info


def refuse_changed_config(saved: Any, cfg: Config, source: str) -> None:
    """One error naming every setting in which ``cfg`` differs from the config a
    checkpoint was written with (``saved``: its JSON text or dict); ``source`` names the
    checkpoint. The one rule for both the launcher (:func:`check_resumable`) and the
    workers (:meth:`Trainer.restore`)."""
    from ddpkit.checkpoint import CheckpointError, config_changes

    if isinstance(saved, str):
        saved = json.loads(saved)
    saved, current = with_current_keys(saved), cfg.identity()
    for section, key in IDENTITY_ADDED:
        # a checkpoint from before the key was part of a run's identity: not compared
        if key not in saved.get(section, {}) and key in current.get(section, {}):
            current[section] = {k: v for k, v in current[section].items() if k != key}
    changes = config_changes(saved, current)
    if changes:
        raise CheckpointError(
            f"{source} was written with other settings ({'; '.join(changes)}); "
            "leave those options out to resume, or start a new run"
        )


def preempted_since(run_dir: Path, since: float) -> CheckpointInfo | None:
    """The newest checkpoint if a stop signal wrote it after ``since`` (a time.time())."""
    found = _checkpoints(run_dir).checkpoints()
    newest = max(found, key=lambda info: info.saved_at, default=None)
    if newest is not None and newest.reason == "preempted" and newest.saved_at >= since:
        return newest
    return None
