"""Checkpoint files: rank 0 writes atomically, every rank loads safely.

PyTorch's DDP tutorials save on rank 0, barrier, and load with ``map_location``. This module makes
that protocol trustworthy:

* **Atomic, durable writes.** Rank 0 streams ``torch.save`` into a hidden temporary file
  in the checkpoint directory (same filesystem, so the rename is atomic), hashing the
  bytes as they go; flush + fsync; rename; then writes a small JSON manifest next to it
  the same way and fsyncs the directory. The manifest is the commit point: a payload
  without a manifest is an interrupted write and is never chosen.
* **Verified loads.** The manifest holds the payload's size and sha256. ``latest()``
  walks back from the newest checkpoint and skips, with a warning that says exactly what
  is wrong, any whose payload or manifest is missing, truncated or corrupt, so a crash
  during a write costs one checkpoint, never the run; a damaged one is never used.
* **A full disk is named.** Running out of space at any write leaves no temporary file
  and no half-committed checkpoint, and raises :class:`~ddpkit.durable.DiskFullError`
  (the path, the bytes needed and free) on every rank.
* **Every rank agrees.** ``save`` and ``load_latest`` are collective when a process group
  exists: rank 0 decides, broadcasts the outcome, and every rank either succeeds or
  raises the same error (no rank left waiting in a barrier for a writer that failed).
* **No code from files.** Loads use ``weights_only=True``; everything stored is tensors,
  numbers, strings, lists and dicts (numpy/python RNG states are converted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint._dist import _initialized, _rank, _world_size, local_device
from ddpkit.durable import (
    TMP_MARK,
    CountingSink,
    DiskFullError,
    atomic_file,
    free_bytes,
    fsync_dir,
    is_disk_full,
    write_atomic,
)
from ddpkit.errors import DdpkitError
from ddpkit.log import get_logger
from ddpkit.writer_fence import StaleWriterError, claim, held

log = get_logger(__name__)

FORMAT = "ddpkit-checkpoint/1"
_NAME = re.compile(r"^step_(\d{9})\.(pt|json)$")
# one file per rank next to the payload (a sharded optimizer's state), listed in the manifest
_SHARD_NAME = re.compile(r"^step_(\d{9})\.rank(\d{5})-of-(\d{5})\.pt$")
RANK_SHARD = "rank_shard"  # state key: this rank's own part, written to its own file
SHARD_FILES = "rank_shard_files"  # state key after a load: every rank's file, by rank


class CheckpointError(DdpkitError, RuntimeError):
    """A checkpoint cannot be written, found, verified or applied to this model/run."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a manifest says about one committed checkpoint."""

    path: Path
    step: int
    size: int
    sha256: str
    world_size: int | None = None
    reason: str = "periodic"
    saved_at: float = 0.0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # caller's, via save(meta=)
    shards: tuple[tuple[str, int, str], ...] = ()  # per-rank files: (name, bytes, sha256)

    @property
    def name(self) -> str:
        return self.path.name


# --------------------------------------------------------------------- helpers
class _HashingWriter:
    """A write-only file wrapper that hashes what passes through, so the checksum costs
    no second read and the payload is never held in memory twice."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self._f.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def _outcome(err: BaseException | None, context: str = "") -> tuple[bool, str, Any]:
    """What a rank tells the others about its part of a collective operation: ok, the
    message, and a :class:`DiskFullError` itself (picklable), so that every rank raises
    the same kind of error."""
    if err is None:
        return True, "", None
    if isinstance(err, DiskFullError):
        return False, str(err), err
    return False, f"{context}{type(err).__name__}: {err}" if context else str(err), None


def _agree(ok: bool, message: str, disk_full: DiskFullError | None = None) -> None:
    """Collective: every rank raises if any rank failed, with the first failure's text
    (a full disk as :class:`DiskFullError` everywhere, the rest as CheckpointError)."""
    outcomes: list[Any] = [(ok, message, disk_full)]
    if _initialized():
        outcomes = [None] * _world_size()
        dist.all_gather_object(outcomes, (ok, message, disk_full))
    for rank, (rank_ok, rank_message, rank_full) in enumerate(outcomes):
        if not rank_ok:
            if rank_full is not None:
                raise rank_full
            suffix = "" if rank == _rank() or not _initialized() else f" (reported by rank {rank})"
            raise CheckpointError(rank_message + suffix)


def _from_rank0(value: Any) -> Any:
    if not _initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _serialized_size(obj: Any) -> int:
    """Bytes ``torch.save`` writes for ``obj``, counted without a disk."""
    sink = CountingSink()
    torch.save(obj, sink)
    return sink.size


def _sha256_file(path: Path, chunk: int = 8 << 20) -> tuple[str, int]:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
            size += len(block)
    return sha.hexdigest(), size


# --------------------------------------------------------------------- Checkpointer
class Checkpointer:
    """``Checkpointer(dir, keep=3)``: atomic rank-0 saves, verified loads, rotation.

    Construct it on every rank (it is collective when a process group exists): rank 0
    creates the directory and proves it can write there, so an unwritable directory is
    a clear error before training starts rather than after the first hour. The
    directory must be shared by all ranks (every rank reads the file rank 0 wrote).
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
        return self.dir / f"step_{step:09d}.pt"

    @staticmethod
    def _manifest_of(payload: Path) -> Path:
        return payload.with_suffix(".json")

    # ---------------------------------------------------------------- saving
    def save(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        reason: str = "periodic",
        meta: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write ``state`` as the checkpoint for ``step`` (collective; rank 0 writes).

        Returns the payload's path on every rank once it is committed. ``reason`` is
        recorded in the manifest (``periodic``, ``preempted``, ``final``...), so a
        launcher can tell a preemption checkpoint from a regular one. ``meta`` (small,
        JSON-able) goes into the manifest too, readable without loading the payload.
        """
        if step < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        path = self.path_for(step)
        shards: list = []
        if RANK_SHARD in state:  # every rank writes its own part first
            mine = state[RANK_SHARD]
            state = {k: v for k, v in state.items() if k != RANK_SHARD}
            shards = self._write_rank_shards(mine, step)
        outcome = _outcome(None)
        if _rank() == 0:
            try:
                with held(self.dir):  # never by a group that a newer one replaced
                    self._write(state, step, reason, dict(meta or {}), shards)
                    self._rotate(keep_newest=path)
            except Exception as err:  # any failure must reach the other ranks, not hang them
                outcome = _outcome(err, f"could not write checkpoint {path}: ")
        # Doubles as the tutorials' barrier: no rank goes on (or loads) before the commit.
        _agree(*outcome)
        return path

    def _write_rank_shards(self, mine: Any, step: int) -> list[tuple[str, int, str]]:
        """Every rank writes its part atomically (nothing left on a failure) and learns
        every rank's (name, bytes, sha256); a failure anywhere raises everywhere (a full
        disk as DiskFullError). Nothing is committed here: the manifest rank 0 writes next
        lists these files."""
        name = f"step_{step:09d}.rank{_rank():05d}-of-{_world_size():05d}.pt"
        outcome, written = _outcome(None), (name, 0, "")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with atomic_file(self.dir / name, size=lambda: _serialized_size(mine)) as f:
                writer = _HashingWriter(f)
                torch.save(mine, writer)
            written = (name, writer.size, writer.sha.hexdigest())
        except Exception as err:  # reported to every rank below
            outcome = _outcome(err, f"could not write {self.dir / name}: ")
        _agree(*outcome)
        if not _initialized():
            return [written]
        everyone: list[Any] = [None] * _world_size()
        dist.all_gather_object(everyone, written)
        return everyone

    def _write(
        self, state: Mapping[str, Any], step: int, reason: str, meta: dict[str, Any],
        shards: list[tuple[str, int, str]] | None = None,
    ) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_temporaries()
        path = self.path_for(step)
        manifest_path = self._manifest_of(path)
        manifest = {"format": FORMAT, "file": path.name, "step": int(step), "bytes": 0,
                    "sha256": "0" * 64, "world_size": _world_size(), "reason": reason,
                    "saved_at": time.time(), "meta": meta}

        def needed() -> int:  # asked only on a full disk: payload and manifest
            return _serialized_size(dict(state)) + len(json.dumps(manifest, indent=1)) + 16

        with atomic_file(path, size=needed) as f:
            writer = _HashingWriter(f)
            torch.save(dict(state), writer)
            if manifest_path.exists():
                # Re-saving a step: uncommit the old pair first so the new payload is
                # never paired with the old manifest.
                manifest_path.unlink()
        manifest.update(bytes=writer.size, sha256=writer.sha.hexdigest())
        if shards:
            manifest["shards"] = [{"file": n, "bytes": b, "sha256": h} for n, b, h in shards]
        try:
            self._write_small(manifest_path, json.dumps(manifest, indent=1).encode())
        except BaseException as err:
            # The payload is in place but uncommitted: remove it rather than leave a
            # checkpoint that looks interrupted.
            path.unlink(missing_ok=True)
            if isinstance(err, DiskFullError):
                raise DiskFullError(manifest_path, writer.size + (err.needed or 0),
                                    free_bytes(self.dir)) from None
            raise
        fsync_dir(self.dir)
        log.debug(f"saved checkpoint {path} ({writer.size / 2**20:.1f} MiB, {reason})")

    def _write_small(self, path: Path, data: bytes) -> None:
        write_atomic(path, data)

    def _remove_temporaries(self) -> None:
        # Leftovers of a writer that died; only rank 0 of one job writes here.
        for entry in self.dir.iterdir():
            if entry.name.startswith(".") and TMP_MARK in entry.name:
                entry.unlink(missing_ok=True)

    def _rotate(self, keep_newest: Path) -> None:
        """Drop all but the newest ``keep`` committed checkpoints, and the leftovers older
        than the one just written: payloads never committed, manifests whose payload is
        gone or that cannot be read. The checkpoint just committed is always kept, so the
        only good one is never deleted."""
        committed = self.checkpoints()
        doomed = [] if self.keep is None else committed[: max(len(committed) - self.keep, 0)]
        for info in doomed:
            if info.path == keep_newest:
                continue
            self._manifest_of(info.path).unlink(missing_ok=True)  # uncommit first
            info.path.unlink(missing_ok=True)
            for name, _size, _sha in info.shards:
                (self.dir / name).unlink(missing_ok=True)
        newest_step = self._step_of(keep_newest)
        readable = {info.step for info in self.checkpoints() if info.path.exists()}
        for step in self._steps():
            if step < newest_step and step not in readable:
                self._manifest_of(self.path_for(step)).unlink(missing_ok=True)
                self.path_for(step).unlink(missing_ok=True)
        for entry in self.dir.iterdir():  # per-rank files of checkpoints never committed
            found = _SHARD_NAME.match(entry.name)
            if found and int(found.group(1)) < newest_step and not self._manifest_of(
                    self.path_for(int(found.group(1)))).exists():
                entry.unlink(missing_ok=True)

    # ---------------------------------------------------------------- listing
    @staticmethod
    def _step_of(path: Path) -> int:
        return int(_NAME.match(path.name).group(1))

    def _steps(self) -> list[int]:
        """Every step with a payload or a manifest in the directory, oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted({self._step_of(p) for p in self.dir.iterdir() if _NAME.match(p.name)})

    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints (a readable manifest exists), oldest first. Not verified:
        a payload may be missing or damaged (:meth:`verify`)."""
        found = []
        for step in self._steps():
            info = self._read_manifest(self.path_for(step))
            if isinstance(info, CheckpointInfo):
                found.append(info)
        return found

    def _read_manifest(self, payload: Path) -> CheckpointInfo | str:
        """The manifest of ``payload``, or what is wrong with it."""
        manifest = self._manifest_of(payload)
        try:
            text = manifest.read_text()
        except FileNotFoundError:
            return (f"its manifest {manifest.name} is missing: the write stopped before its "
                    "commit, or the manifest was deleted")
        except (OSError, UnicodeDecodeError) as err:
            return f"its manifest {manifest.name} cannot be read ({err})"
        try:
            meta = json.loads(text)
            info = CheckpointInfo(
                path=payload,
                step=int(meta["step"]),
                size=int(meta["bytes"]),
                sha256=str(meta["sha256"]),
                world_size=meta.get("world_size"),
                reason=str(meta.get("reason", "periodic")),
                saved_at=float(meta.get("saved_at", 0.0)),
                meta=dict(meta.get("meta") or {}),
                shards=tuple((str(e["file"]), int(e["bytes"]), str(e["sha256"]))
                             for e in meta.get("shards", ())),
            )
        except ValueError as err:
            what = "empty" if not text.strip() else f"not valid JSON ({err})"
            return f"its manifest {manifest.name} is damaged: truncated or corrupt, {what}"
        except (KeyError, TypeError, AttributeError) as err:
            return f"its manifest {manifest.name} is damaged: no valid field {err}"
        if info.step != self._step_of(payload):
            return f"its manifest {manifest.name} describes step {info.step}, not this file"
        return info

    def verify(self, info: CheckpointInfo) -> str | None:
        """Why ``info``'s payload cannot be trusted, or None if it matches its manifest."""
        try:
            actual_size = info.path.stat().st_size
        except OSError:
            return (f"the payload file is missing (its manifest "
                    f"{self._manifest_of(info.path).name} is there): deleted or moved")
        if actual_size < info.size:
            return f"truncated: {actual_size} bytes, its manifest says {info.size}"
        if actual_size > info.size:
            return f"overwritten: {actual_size} bytes, its manifest says {info.size}"
        digest, _ = _sha256_file(info.path)
        if digest != info.sha256:
            return "sha256 mismatch: its bytes changed after it was written (corrupt)"
        for name, size, sha in info.shards:
            shard = self.dir / name
            try:
                actual_size = shard.stat().st_size
            except OSError:
                return f"per-rank file {name} is missing"
            if actual_size != size or _sha256_file(shard)[0] != sha:
                return f"per-rank file {name} is truncated or corrupt"
        return None

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint that verifies, with a warning for each newer one skipped
        that says what is wrong with it and what is used instead.

        Local (not collective): call it on one rank, or use :meth:`load_latest`.
        """
        problems: list[tuple[Path, str]] = []
        for step in reversed(self._steps()):
            payload = self.path_for(step)
            info = self._read_manifest(payload)
            problem = info if isinstance(info, str) else self.verify(info)
            if problem is None:
                for damaged, why in problems:
                    log.warning(f"skipping checkpoint {damaged}: {why}; falling back to "
                                f"{info.name} (step {info.step})")
                return info
            problems.append((payload, problem))
        for i, (damaged, why) in enumerate(problems):
            older = len(problems) - 1 - i
            rest = ("no older checkpoint to fall back to" if older == 0 else
                    f"the {older} older one{'s are' if older > 1 else ' is'} damaged too")
            log.warning(f"skipping checkpoint {damaged}: {why}; {rest}")
        return None

    # ---------------------------------------------------------------- loading
    def load(self, path: str | os.PathLike, map_location: Any = None) -> dict[str, Any]:
        """Load one checkpoint file with ``weights_only=True`` onto the local device."""
        path = Path(path)
        if map_location is None:
            map_location = local_device()
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {path} not found on rank {_rank()}; the checkpoint directory "
                "must be on a filesystem every rank can read"
            ) from None
        except pickle.UnpicklingError as err:
            # torch's text suggests weights_only=False: the one thing not to do with a file
            # that carries code. Say what is in it instead.
            found = [ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln or "global" in ln]
            detail = f" ({found[0]})" if found else ""
            raise CheckpointError(
                f"refusing to load checkpoint {path}: it holds Python objects, not only tensors "
                f"and plain data{detail}; ddpkit loads with weights_only=True so that a "
                "checkpoint cannot run code"
            ) from None
        except Exception as err:  # torch raises many types for bad archives
            text = str(err).strip() or type(err).__name__
            first = text.splitlines()[0].split(". ")[0]
            raise CheckpointError(
                f"cannot load checkpoint {path}: {first}; the file is damaged or not a checkpoint"
            ) from None
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a dict")
        info = self._read_manifest(path)
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
