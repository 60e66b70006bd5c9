"""What the checkpoint store's parts share: its error, what a manifest says, streaming
hashes, and how ranks agree on the outcome of a collective write or load."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint._dist import _initialized, _rank, _world_size
from ddpkit.errors import DdpkitError
from ddpkit.files.durable import CountingSink, DiskFullError

DCP_KEYS = ("model", "optimizer")  # what goes into DCP; the rest is the run's own state
IN_DCP = "in_dcp"  # run.pt's list of the DCP_KEYS its DCP checkpoint holds


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
    shards: tuple[tuple[str, int, str], ...] = ()  # format 1 rank files: (name, bytes, sha)
    files: tuple[tuple[str, int, str], ...] = ()  # step directory files: (name, bytes, sha)

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


def load_payload(path: Path, map_location: Any) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` of a dict, any failure one CheckpointError
    line (never torch's advice to retry with ``weights_only=False``)."""
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
    return state
