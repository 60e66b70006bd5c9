"""Where a run of ``ddpkit train`` lives, decided once from the command line.

A :class:`RunPlan` says which run directory the command writes and whether it continues
a run there (``--resume``, or ``--run-dir`` naming a run that stopped before its end:
a scheduler's rerun of the same command line). The launching ``ddpkit train`` makes the
plan, creates and locks the directory and hands the workers its decision
(``--resume DIR`` or ``--run-dir DIR``); a worker started by another launcher makes the
same plan from its own command line, and its rank 0 creates and locks the directory.
The directory's name, its creation and its lock are this module's, whoever asks.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from pathlib import Path

from ddpkit.errors import ConfigError
from ddpkit.files.run_lock import RunLock, held_for_us
from ddpkit.train import report, resume
from ddpkit.train.config import Config, resolve
from ddpkit.train.recipe import short_name


def run_tag(cfg: Config, world_size: int) -> str:
    """The end of a new run directory's name: data, model and world size."""
    return f"{short_name(cfg.data.name)}-{short_name(cfg.model.name)}-w{world_size}"


@dataclass(frozen=True)
class RunPlan:
    run_dir: Path | None = None  # None: a new directory under --out-dir, named when made
    resume: bool = False  # continue from run_dir's newest checkpoint (one is required)
    rerun: bool = False  # --run-dir named a stopped run: this command continues it
    recheck: bool = False  # a person's --run-dir: read it again under the lock

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, launching: bool) -> RunPlan:
        """The plan the options ask for. ``launching``: this is the command a person ran
        (``--run-dir R`` holding a stopped run continues it); a worker takes ``--run-dir``
        as its launcher decided it."""
        if args.resume is not None:
            if args.run_dir is not None:
                raise ConfigError("--resume and --run-dir: give one (--resume RUN_DIR "
                                  "continues RUN_DIR; --run-dir starts a new run there)")
            out_dir = args.out_dir
            if out_dir is None and args.resume == resume.LATEST:
                out_dir = resolve(vars(args), args.config).train.out_dir
            return cls(resume.find_run_dir(args.resume, out_dir or Config().train.out_dir),
                       resume=True)
        if args.run_dir is None:
            return cls()
        if not launching:
            return cls(Path(args.run_dir))
        rerun = resume.run_to_continue(Path(args.run_dir)) is not None
        return cls(Path(args.run_dir), resume=rerun, rerun=rerun, recheck=True)

    @property
    def resume_dir(self) -> Path | None:
        return self.run_dir if self.resume else None

    def made(self, cfg: Config, world_size: int) -> RunPlan:
        """This plan with its directory created (a new one named for the run)."""
        if self.resume:
            return self
        if self.run_dir is None:
            return replace(self, run_dir=report.new_run_dir(cfg.train.out_dir,
                                                            run_tag(cfg, world_size)))
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--run-dir {self.run_dir}: cannot create it "
                              f"({exc.strerror})") from None
        if not os.access(self.run_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"--run-dir {self.run_dir} is not writable; choose another")
        return self

    def lock(self) -> RunLock | None:
        """The run directory's lock for this process, unless the launcher that started it
        holds it already. A ``--run-dir`` read again under the lock must mean what it meant
        before: a run still going when it was first looked at may have ended since."""
        if self.run_dir is None or held_for_us(self.run_dir):
            return None
        lock = RunLock.acquire(self.run_dir)
        if self.recheck:
            try:  # a finished run raises its own line here
                if resume.run_to_continue(self.run_dir) != self.resume_dir:
                    raise ConfigError(f"--run-dir {self.run_dir} was written by another "
                                      "ddpkit train while this one started; run the same "
                                      "command again")
            except BaseException:
                lock.release()
                raise
        return lock
