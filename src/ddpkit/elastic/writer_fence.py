"""One group of workers writes a run's checkpoints at a time, even when an old group is
not quite dead.

An elastic job that loses a host meets again without it, as a new *generation* of the
job (torch's rendezvous counts them: the round). A worker of the old generation may
still be alive for a moment: its host was cut off the network in the middle of a
checkpoint, say. If it went on writing, two groups would write one directory: its
temporary files, rotation and manifest racing the new group's.

So the checkpoint directory holds a small fence file naming the newest generation that
took it over, and every change to the directory happens under an exclusive ``flock`` of
that file:

* :func:`claim`: a group's rank 0 takes the directory over before it reads anything
  (a generation older than the one recorded is stale and stops);
* :func:`held`: rank 0 writes a checkpoint only while the fence still names its own
  generation; an old generation finds the new one there and stops without writing.

A checkpoint committed by the old group *before* the new group's claim is whole (the
commit is atomic) and the new group may resume from it; nothing the old group writes
after the claim reaches the directory. The launcher names the generation in
:data:`GENERATION_ENV` (``<job id>:<round>``); without it (one node, another launcher)
there is nothing to fence. The lock needs a filesystem whose ``flock`` works for every
host (local, or NFS with its lock manager), as ddpkit's run lock does. Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from ddpkit.errors import DdpkitError

GENERATION_ENV = "DDPKIT_GENERATION"  # "<rendezvous id>:<round>", set by the launcher
FENCE_FILE = ".ddpkit-writers"


class StaleWriterError(DdpkitError, RuntimeError):
    """A worker of an older generation of the job tried to write the run's checkpoints."""


def generation(env: dict[str, str] | None = None) -> tuple[str, int] | None:
    """This process's generation, (job id, round), or None outside an elastic job."""
    value = (os.environ if env is None else env).get(GENERATION_ENV, "")
    job, sep, round_ = value.rpartition(":")
    return (job, int(round_)) if sep and round_.isdigit() else None


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[int]:
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / FENCE_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # drops the lock


def _recorded(fd: int) -> tuple[str, int] | None:
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    job, sep, round_ = text.rpartition(":")
    return (job, int(round_)) if sep and round_.isdigit() else None


def _stale(mine: tuple[str, int], newer: tuple[str, int]) -> StaleWriterError:
    return StaleWriterError(
        f"this worker belongs to round {mine[1]} of job {mine[0]!r}, and round {newer[1]} "
        "has taken the run over (this host was lost and the others went on without it); "
        "it stops without writing")


def claim(directory: str | os.PathLike) -> None:
    """Take ``directory`` over for this generation (rank 0, before reading it)."""
    mine = generation()
    if mine is None:
        return
    with _locked(Path(directory)) as fd:
        recorded = _recorded(fd)
        if recorded is not None and recorded[0] == mine[0] and recorded[1] > mine[1]:
            raise _stale(mine, recorded)
        data = f"{mine[0]}:{mine[1]}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)


@contextlib.contextmanager
def held(directory: str | os.PathLike) -> Iterator[None]:
    """Write into ``directory`` only while it is still this generation's."""
    mine = generation()
    if mine is None:
        yield
        return
    with _locked(Path(directory)) as fd:
        recorded = _recorded(fd)
        if recorded is not None and recorded != mine:
            raise _stale(mine, recorded)
        yield
