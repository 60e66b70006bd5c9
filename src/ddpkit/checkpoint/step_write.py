"""Writing one step's checkpoint directory: every rank its DCP part, rank 0 the run's
state and the manifest, all in a hidden temporary directory that one rename commits.

Collective; the order matters for what a crash or a failure leaves:

1. rank 0 removes leftovers of a writer that died and makes ``.step_N.tmp-PID``;
2. every rank writes its part of the model and optimizer with ``dcp.save`` (DCP's
   ``.metadata`` last), each file hashed as it is written;
3. rank 0 writes ``run.pt`` (atomically, hashed on the way);
4. every rank tells the others its outcome and its files' (bytes, sha256);
5. rank 0 writes the manifest, fsyncs the directory and commits (the caller's rename).

A failure anywhere removes the temporary directory and raises the same error on every
rank (a full disk as :class:`~ddpkit.files.durable.DiskFullError` naming the checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ddpkit.checkpoint._dist import _initialized, _rank, _world_size
from ddpkit.checkpoint.common import (
    DCP_KEYS,
    IN_DCP,
    CheckpointError,
    _from_rank0,
    _HashingWriter,
    _outcome,
    _serialized_size,
)
from ddpkit.checkpoint.dcp_files import (
    METADATA,
    dcp_quiet,
    disk_full_in,
    failure_text,
    hashing_writer,
)
from ddpkit.files.durable import (
    TMP_MARK,
    DiskFullError,
    atomic_file,
    free_bytes,
    fsync_dir,
    write_atomic,
)


def _fqn_keyed(name: str, value: Any) -> bool:
    """Whether ``value`` is named as torch's state_dict helpers name things (a model's
    state dict; an optimizer's state keyed by parameter names, not positions)."""
    if not isinstance(value, Mapping):
        return False
    if name == "model":
        return True
    state = value.get("state")
    return isinstance(state, Mapping) and all(isinstance(k, str) for k in state)


def split_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what DCP writes, what ``run.pt`` holds)."""
    dcp_part = {k: state[k] for k in DCP_KEYS if k in state and _fqn_keyed(k, state[k])}
    run_part = {k: v for k, v in state.items() if k not in dcp_part}
    if dcp_part:
        run_part[IN_DCP] = sorted(dcp_part)
    return dcp_part, run_part


def remove_temporaries(directory: Path) -> None:
    """Leftovers of a writer that died: hidden temporary files and directories (only
    rank 0 of one job writes here)."""
    for entry in directory.iterdir():
        if entry.name.startswith(".") and TMP_MARK in entry.name:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    shards = getattr(obj, "local_shards", None)
    if callable(shards):
        return sum(_tensor_bytes(s.tensor) for s in shards())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return 0


def _raise(outcomes: list[tuple[bool, str, Any]]) -> None:
    for rank, (ok, message, full) in enumerate(outcomes):
        if not ok:
            if full is not None:
                raise full
            mine = rank == _rank() or not _initialized()
            raise CheckpointError(message + ("" if mine else f" (reported by rank {rank})"))


def _exchange(outcome: tuple[bool, str, Any], files: dict[str, tuple[int, str]]
              ) -> tuple[list[tuple[bool, str, Any]], dict[str, tuple[int, str]]]:
    """Every rank's outcome, by rank, and every rank's files merged."""
    everyone: list[Any] = [(outcome, files)]
    if _initialized():
        everyone = [None] * _world_size()
        dist.all_gather_object(everyone, (outcome, files))
    merged: dict[str, tuple[int, str]] = {}
    for _, rank_files in everyone:
        merged.update(rank_files)
    return [o for o, _ in everyone], merged


def _write_dcp(tmp: Path, final: Path, part: dict[str, Any], run_bytes: Callable[[], int]
               ) -> tuple[tuple[bool, str, Any], dict[str, tuple[int, str]]]:
    writer, written = hashing_writer(tmp)
    try:
        with dcp_quiet():
            dcp.save(part, storage_writer=writer, no_dist=not _initialized())
    except CheckpointException as err:
        if disk_full_in(err):
            needed = _tensor_bytes(part) + (run_bytes() if _rank() == 0 else 0)
            return _outcome(DiskFullError(final, needed, free_bytes(final.parent))), {}
        line, _ = failure_text(err)
        return _outcome(CheckpointError(f"could not write checkpoint {final}: {line}")), {}
    except Exception as err:  # planning failed before any write: the same on every rank
        return _outcome(err, f"could not write checkpoint {final}: "), {}
    files = dict(written)
    if METADATA + ".tmp" in files:  # DCP writes it under a temporary name, then renames
        files[METADATA] = files.pop(METADATA + ".tmp")
    return _outcome(None), files


def write_step(directory: Path, final: Path, state: Mapping[str, Any],
               manifest: dict[str, Any], manifest_name: str, run_name: str,
               commit: Callable[[Path], None]) -> None:
    """Collective: write ``state`` as the checkpoint directory ``final`` (see above)."""
    dcp_part, run_part = split_state(state)
    prepared: tuple[str | None, tuple[bool, str, Any], bool] = (None, _outcome(None), False)
    if _rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            remove_temporaries(directory)
            tmp = directory / f".{final.name}{TMP_MARK}{os.getpid()}"
            tmp.mkdir()
            prepared = (str(tmp), _outcome(None), bool(dcp_part))
        except Exception as err:
            prepared = (None, _outcome(err, f"could not write checkpoint {final}: "), False)
    where, outcome, with_dcp = _from_rank0(prepared)
    _raise([outcome])
    tmp = Path(where)

    def run_bytes() -> int:
        return _serialized_size(run_part)

    files: dict[str, tuple[int, str]] = {}
    if with_dcp:  # rank 0 decides, so that every rank enters dcp.save
        outcome, files = _write_dcp(tmp, final, dcp_part, run_bytes)
    if _rank() == 0 and outcome[0]:
        try:
            with atomic_file(tmp / run_name, size=run_bytes) as f:
                hashing = _HashingWriter(f)
                torch.save(run_part, hashing)
            files[run_name] = (hashing.size, hashing.sha.hexdigest())
        except DiskFullError as err:
            outcome = _outcome(DiskFullError(final, err.needed, err.free))
        except Exception as err:  # any failure must reach the other ranks, not hang them
            outcome = _outcome(err, f"could not write checkpoint {final}: ")
    outcomes, files = _exchange(outcome, files)
    if not all(ok for ok, _, _ in outcomes):  # every rank holds the same list: no hang
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise(outcomes)
    if _rank() == 0:
        try:
            manifest["files"] = {name: {"bytes": size, "sha256": sha}
                                 for name, (size, sha) in sorted(files.items())}
            manifest["bytes"] = sum(size for size, _ in files.values())
            write_atomic(tmp / manifest_name, json.dumps(manifest, indent=1).encode())
            fsync_dir(tmp)
            commit(tmp)
        except DiskFullError as err:
            outcome = _outcome(DiskFullError(final, manifest.get("bytes"), err.free))
        except Exception as err:
            outcome = _outcome(err, f"could not write checkpoint {final}: ")
        if tmp.exists():  # not committed: nothing of this step is left
            shutil.rmtree(tmp, ignore_errors=True)
    # Doubles as the tutorials' barrier: no rank goes on (or loads) before the commit.
    _raise(_exchange(outcome, {})[0])
