"""POSIX shared-memory segments: named per run, created by one rank, unlinked early.

A segment is a file in ``/dev/shm`` (what ``shm_open`` creates on Linux) mapped into
every rank of a host. Its name carries the run id and the creator's pid,
``ddpkit-shm-<run>-<pid>-<tag>-<random>``, so that a restarted job can tell its own
leftovers (creator dead) from segments other live jobs are still setting up.

The file exists only between creation and the moment every rank has attached: the
creator unlinks it then, and the kernel frees the memory when the last mapping goes,
however the processes end (exit, exception, SIGKILL). Only a crash inside that short
window leaves a file behind, and :func:`remove_stale` clears it at the next start.

Space is reserved with ``posix_fallocate`` at creation. A tmpfs that fills up later
would otherwise deliver SIGBUS on first touch of a page, in the middle of training;
reserving up front turns that into an error we can report or fall back from.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
PREFIX = "ddpkit-shm"
PAGE = mmap.PAGESIZE

_SAFE = re.compile(r"[^A-Za-z0-9_.]")


def available() -> bool:
    """Whether this system has a POSIX shared-memory directory we can use."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def round_up(nbytes: int, to: int = PAGE) -> int:
    return -(-nbytes // to) * to


def run_prefix(run_id: str) -> str:
    # '-' separates name fields, so it must not appear inside the run id.
    return f"{PREFIX}-{_SAFE.sub('_', run_id)[:48]}-"


def new_name(run_id: str, tag: str) -> str:
    return f"{run_prefix(run_id)}{os.getpid()}-{_SAFE.sub('_', tag)}-{secrets.token_hex(4)}"


def _creator_pid(name: str, prefix: str) -> int | None:
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale(run_id: str) -> list[str]:
    """Unlink this run's segments whose creator is dead; returns the names removed.

    A live creator's segment is never touched: it may be waiting for its peers to attach.
    """
    prefix = run_prefix(run_id)
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = _creator_pid(name, prefix)
        if pid is None or pid_alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):  # another rank may have won the race
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    return removed


@dataclass
class Segment:
    name: str
    size: int
    buffer: mmap.mmap | None  # None once closed
    linked: bool  # whether the name still exists in /dev/shm

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Forget the mapping; it is unmapped when the last tensor viewing it goes.

        Never ``mmap.close()``: torch.frombuffer keeps a reference to the mmap but no
        buffer export, so closing would unmap memory that live tensors still point at.
        """
        self.unlink()
        self.buffer = None


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault pages in now, not mid-step
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def create(name: str, size: int) -> Segment:
    """Create, reserve and map a zero-filled segment; raises OSError (e.g. ENOSPC)."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        buffer = _map(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return Segment(name, size, buffer, linked=True)


def attach(name: str, size: int) -> Segment:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise OSError(f"segment {name} has {actual} bytes, expected {size}")
        buffer = _map(fd, size)
    finally:
        os.close(fd)
    return Segment(name, size, buffer, linked=False)
