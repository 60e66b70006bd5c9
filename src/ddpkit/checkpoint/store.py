"""Checkpoint directories: torch.distributed.checkpoint (DCP) inside ddpkit's protections.

One checkpoint is one directory per step, ``step_000000100/``:

* ``.metadata`` and ``__R_0.distcp``: a DCP checkpoint of the model and the optimizer
  (``dcp.save``; every rank writes its own file: a replicated tensor once, by one rank;
  a ZeRO shard by the rank that owns it, at its offsets). torch's tools read it
  (``dcp.load``, ``format_utils.dcp_to_torch_save``).
* ``run.pt``: the run's own state (step, epoch, data position, random streams, config
  fingerprint, scheduler, ...), one ``torch.save`` by rank 0, loaded ``weights_only``.
* ``manifest.json``: step, world size, reason, time, the caller's meta, and every file's
  size and sha256, each hashed as it was written (no second read).

What DCP leaves to its caller:

* **Whole or nothing.** Everything is written into a hidden temporary directory
  (``.step_000000100.tmp-PID``) in the same place; once every rank has written its part
  and rank 0 the manifest, rank 0 renames it to ``step_000000100`` and fsyncs the parent:
  the rename is the commit. A kill at any moment leaves the previous checkpoints and,
  at most, a hidden temporary that is never chosen and is removed by the next save.
* **Verified loads.** ``latest()`` walks back from the newest checkpoint, checks every
  file against the manifest and skips, with a warning naming the damage, any that
  fails; a damaged checkpoint is never used.
* **A full disk is named**: one :class:`~ddpkit.files.durable.DiskFullError` on every rank,
  nothing left behind.
* **Every rank agrees**: a failure on any rank raises the same error on every rank.
* **No code from files**: ``run.pt`` loads ``weights_only``; DCP's pickled ``.metadata``
  and non-tensor values load through restricted unpicklers (``dcp_files``).

Format 1 checkpoints (``step_N.pt`` + ``step_N.json``) are still listed, verified,
loaded and rotated (:mod:`~ddpkit.checkpoint.legacy`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.checkpoint import legacy
from ddpkit.checkpoint._dist import _rank, _world_size, local_device
from ddpkit.checkpoint.common import (
    DCP_KEYS,
    CheckpointError,
    CheckpointInfo,
    _agree,
    _from_rank0,
    _outcome,
    _sha256_file,
    load_payload,
)
from ddpkit.elastic.writer_fence import StaleWriterError, claim, held
from ddpkit.files.durable import TMP_MARK, DiskFullError, free_bytes, fsync_dir, is_disk_full
from ddpkit.log import get_logger

log = get_logger(__name__)

FORMAT = "ddpkit-checkpoint/2"
MANIFEST = "manifest.json"
RUN_FILE = "run.pt"
DCP_DIR = "dcp_dir"  # state key after a load: the DCP checkpoint holding model/optimizer
SHARD_FILES = "rank_shard_files"  # format 1, state key after a load: every rank's file
_STEP_DIR = re.compile(r"^step_(\d{9})$")

__all__ = ["DCP_DIR", "DCP_KEYS", "FORMAT", "SHARD_FILES", "CheckpointError", "CheckpointInfo",
           "Checkpointer"]


class Checkpointer:
    """``Checkpointer(dir, keep=3)``: collective saves, verified loads, rotation.

    Construct it on every rank (it is collective when a process group exists): rank 0
    creates the directory and proves it can write there, so an unwritable directory is
    a clear error before training starts rather than after the first hour. The
    directory must be shared by all ranks (each writes its part of a checkpoint there).
    ``keep``: how many committed checkpoints to retain (``None``: all). Only one job
    may write to a directory at a time. ``create=False`` opens a directory only to list
    and load (no probe, nothing created, not collective): for tools that inspect a run.
    """

    def __init__(
        self, directory: str | os.PathLike, keep: int | None = 3, *, create: bool = True
    ):
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep must be >= 1 (or None for all), got {keep}")
        self.dir = Path(directory)
        self.keep = keep
        if not create:
            return
        outcome = _outcome(None)
        if _rank() == 0:
            try:
                self._check_writable()
                claim(self.dir)  # an elastic job's newest group owns the directory
            except (CheckpointError, DiskFullError, StaleWriterError) as err:
                outcome = _outcome(err)
        _agree(*outcome)

    def _check_writable(self) -> None:
        if self.dir.exists() and not self.dir.is_dir():
            raise CheckpointError(
                f"checkpoint directory {self.dir} exists and is not a directory; pick another path"
            )
        probe = self.dir / f".write-probe{TMP_MARK}{os.getpid()}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"ok")
            probe.unlink()
        except OSError as err:
            with contextlib.suppress(OSError):
                probe.unlink()
            if is_disk_full(err):
                raise DiskFullError(self.dir, None, free_bytes(self.dir)) from None
            raise CheckpointError(
                f"checkpoint directory {self.dir} is not writable ({err.strerror or err}); "
                "fix its permissions or choose another directory"
            ) from None

    # ---------------------------------------------------------------- naming
    def path_for(self, step: int) -> Path:
        """The directory of step ``step``'s checkpoint."""
        return self.dir / f"step_{step:09d}"

    # ---------------------------------------------------------------- saving
    def save(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        reason: str = "periodic",
        meta: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write ``state`` as the checkpoint for ``step`` (collective: every rank calls it
        with its own state; each writes its part of ``model`` and ``optimizer`` through
        DCP, rank 0 the rest).

        Returns the checkpoint's directory on every rank once it is committed. ``reason``
        is recorded in the manifest (``periodic``, ``preempted``, ``final``...), so a
        launcher can tell a preemption checkpoint from a regular one. ``meta`` (small,
        JSON-able) goes into the manifest too, readable without loading anything else.
        """
        if step < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        final = self.path_for(step)
        manifest = {"format": FORMAT, "step": int(step), "world_size": _world_size(),
                    "reason": reason, "saved_at": time.time(), "meta": dict(meta or {})}
        # DCP's import takes most of a second: tools that only list checkpoints (the
        # launcher's look at a run that ended) do without it
        from ddpkit.checkpoint.step_write import write_step

        write_step(self.dir, final, state, manifest, MANIFEST, RUN_FILE,
                   commit=lambda tmp: self._commit(tmp, final))
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rank 0: the rename that makes ``tmp`` the checkpoint ``final``, then rotation;
        never by a group that a newer one replaced."""
        with held(self.dir):
            old = None
            if final.exists():  # saving a step again: the old one leaves first, unseen
                old = final.with_name(f".{final.name}{TMP_MARK}old-{os.getpid()}")
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(self.dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._rotate(keep_newest=int(final.name.split("_")[1]))

    def _remove(self, step: int, info: CheckpointInfo | None = None) -> None:
        path = self.path_for(step)
        if path.is_dir():  # out of sight first (one rename), then its files
            gone = path.with_name(f".{path.name}{TMP_MARK}gone-{os.getpid()}")
            os.replace(path, gone)
            shutil.rmtree(gone, ignore_errors=True)
        legacy.remove(self.dir, step, info if info is not None and not info.files else None)

    def _rotate(self, keep_newest: int) -> None:
        """Drop all but the newest ``keep`` committed checkpoints, and the leftovers older
        than the one just written: checkpoints never committed, manifests whose payload is
        gone or that cannot be read. The checkpoint just committed is always kept, so the
        only good one is never deleted."""
        committed = self.checkpoints()
        doomed = [] if self.keep is None else committed[: max(len(committed) - self.keep, 0)]
        for info in doomed:
            if info.step != keep_newest:
                self._remove(info.step, info)
        readable = {info.step for info in self.checkpoints() if info.path.exists()
                    and all((info.path / name).exists() for name, _, _ in info.files)}
        for step in self._steps():
            if step < keep_newest and step not in readable:
                self._remove(step)
        legacy.remove_orphan_rank_files(self.dir, keep_newest)

    # ---------------------------------------------------------------- listing
    def _steps(self) -> list[int]:
        """Every step with a checkpoint directory, payload or manifest here, oldest first."""
        if not self.dir.is_dir():
            return []
        found = legacy.steps(self.dir)
        found |= {int(m.group(1)) for p in self.dir.iterdir() if (m := _STEP_DIR.match(p.name))}
        return sorted(found)

    def _where(self, step: int) -> Path:
        """Step ``step``'s checkpoint: its directory, or a format 1 payload."""
        path = self.path_for(step)
        return path if path.is_dir() else legacy.payload(self.dir, step)

    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints (a readable manifest exists), oldest first. Not verified:
        a file may be missing or damaged (:meth:`verify`)."""
        return [info for step in self._steps()
                if isinstance(info := self._read_manifest(step), CheckpointInfo)]

    def _read_manifest(self, step: int) -> CheckpointInfo | str:
        """Step ``step``'s manifest, or what is wrong with it."""
        path = self._where(step)
        if path.suffix == ".pt":
            return legacy.read_manifest(path, step)
        try:
            text = (path / MANIFEST).read_text()
        except FileNotFoundError:
            return f"its manifest {MANIFEST} is missing (deleted)"
        except (OSError, UnicodeDecodeError) as err:
            return f"its manifest {MANIFEST} cannot be read ({err})"
        return legacy.parse_manifest(path, text, step)

    def verify(self, info: CheckpointInfo) -> str | None:
        """Why ``info``'s files cannot be trusted, or None if they match its manifest."""
        if not info.files:
            return legacy.verify(info)
        for name, size, sha in info.files:
            try:
                actual = (info.path / name).stat().st_size
            except OSError:
                return f"its file {name} is missing (deleted or moved)"
            if actual < size:
                return f"its file {name} is truncated: {actual} bytes, its manifest says {size}"
            if actual > size:
                return f"its file {name} is overwritten: {actual} bytes, its manifest says {size}"
            if _sha256_file(info.path / name)[0] != sha:
                return (f"its file {name} has a sha256 mismatch: its bytes changed after it "
                        "was written (corrupt)")
        return None

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint that verifies, with a warning for each newer one skipped
        that says what is wrong with it and what is used instead.

        Local (not collective): call it on one rank, or use :meth:`load_latest`.
        """
        problems: list[tuple[Path, str]] = []
        for step in reversed(self._steps()):
            info = self._read_manifest(step)
            problem = info if isinstance(info, str) else self.verify(info)
            if problem is None:
                for damaged, why in problems:
                    log.warning(f"skipping checkpoint {damaged}: {why}; falling back to "
                                f"{info.name} (step {info.step})")
                return info
            problems.append((self._where(step), problem))
        for i, (damaged, why) in enumerate(problems):
            older = len(problems) - 1 - i
            rest = ("no older checkpoint to fall back to" if older == 0 else
                    f"the {older} older one{'s are' if older > 1 else ' is'} damaged too")
            log.warning(f"skipping checkpoint {damaged}: {why}; {rest}")
        return None

    # ---------------------------------------------------------------- loading
    def load(self, path: str | os.PathLike, map_location: Any = None) -> dict[str, Any]:
        """The run's state of one checkpoint (``weights_only``, onto the local device).

        A checkpoint directory's model and optimizer stay on disk: the state names
        their DCP checkpoint under ``DCP_DIR``, and :func:`~ddpkit.checkpoint.restore_state`
        loads each rank's part of them into the model and optimizer it is given.
        """
        path = Path(path)
        if map_location is None:
            map_location = local_device()
        if path.is_dir():
            state = load_payload(path / RUN_FILE, map_location)
            if (path / ".metadata").exists():
                state[DCP_DIR] = str(path)
            return state
        state = load_payload(path, map_location)
        info = legacy.read_manifest(path, int(path.name[5:14])) if legacy.NAME.match(
            path.name) else None
        if isinstance(info, CheckpointInfo) and info.shards:
            # Not loaded here: each is read once, by whoever needs its part.
            state[SHARD_FILES] = [str(path.parent / name) for name, _size, _sha in info.shards]
        return state

    def load_latest(self, map_location: Any = None) -> dict[str, Any] | None:
        """Collective resume: rank 0 picks the newest good checkpoint, every rank loads it.

        Returns the state dict, or None on every rank when there is nothing to resume.
        """
        chosen = None
        if _rank() == 0:
            info = self.latest()
            chosen = None if info is None else str(info.path)
        chosen = _from_rank0(chosen)
        if chosen is None:
            return None
        state, ok, message = None, True, ""
        try:
            state = self.load(chosen, map_location)
        except CheckpointError as err:
            ok, message = False, str(err)
        _agree(ok, message)
        step = state.get("step")
        log.info(f"resuming from {chosen}" + ("" if step is None else f" (step {step})"))
        return state

