"""Files that a crash or a full disk never leave half-written.

What a run leaves on disk (checkpoints and their manifests, the final weights, the
summary, the metric logs) goes through here: into a hidden temporary file beside its
destination (same filesystem, so the rename is atomic), flushed and fsync'd, renamed
over the destination, and the directory fsync'd so that the rename itself survives a
power cut. Whatever fails on the way, the temporary file is removed: a reader sees the
old file or the new one, and no ``*.tmp`` is left behind.

A full disk (``ENOSPC``, or ``EDQUOT`` when a quota is reached) becomes one
:class:`DiskFullError` naming the file, the bytes it needed and the bytes free there:
what a user can act on, instead of the error of whichever layer noticed first (torch's
zip writer says ``unexpected pos``). Processes that end on it exit with
:data:`EXIT_DISK_FULL`.

Torch-free: the launching process uses it before any worker starts.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ddpkit.errors import DdpkitError

TMP_MARK = ".tmp-"  # temporaries are ".<name>.tmp-<pid>": hidden, one per writing process
_FULL = (errno.ENOSPC, errno.EDQUOT)
# A write that failed where less than this is free is taken for a full disk even when
# its errno was lost: some layers report a short write in their own words (torch's zip
# writer raises a RuntimeError), and an exception that crossed processes (DCP gathers
# every rank's failure to all) has lost the OSError it was raised from.
NEARLY_FULL = 1 << 20


class DiskFullError(DdpkitError):
    """A file could not be written for lack of space; nothing half-written was left."""

    def __init__(self, path: str | os.PathLike, needed: int | None, free: int | None,
                 advice: str = "free some space there and run the same command again"):
        self.path, self.needed, self.free, self.advice = Path(path), needed, free, advice
        have = f"{_bytes(free)} free there" if free is not None else "free space unknown"
        if needed is not None:
            what = f"to write {self.path}: it needs {_bytes(needed)}, {have}"
        else:  # a log append or a probe: the size that would have sufficed is not known
            what = f"writing in {self.path} ({have})"
        super().__init__(f"no space left on device {what}; {advice}")

    def __reduce__(self):  # picklable with its fields (the message is rebuilt from them)
        return (DiskFullError, (self.path, self.needed, self.free, self.advice))

    def with_advice(self, advice: str) -> DiskFullError:
        """The same error with another last clause (what to do), for an application that
        knows the command that continues its work."""
        return DiskFullError(self.path, self.needed, self.free, advice)


def _bytes(n: int) -> str:
    if n < 1 << 20:
        return f"{n:,} bytes"
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)"


def is_disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from) is a full disk or quota."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, DiskFullError) or (isinstance(err, OSError) and err.errno in _FULL):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def failed_for_space(err: BaseException, where: str | os.PathLike) -> bool:
    """Whether a write into ``where`` that raised ``err`` failed for lack of space: a
    full disk in ``err``'s chain, or an I/O error of any wording (``OSError``, or the
    ``RuntimeError`` of a C++ writer) where next to nothing is free. Other errors (an
    object that cannot be pickled, say) stay what they are, however full the disk."""
    if is_disk_full(err):
        return True
    if not isinstance(err, (OSError, RuntimeError)):
        return False
    free = free_bytes(where)
    return free is not None and free < NEARLY_FULL


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class CountingSink:
    """A write-only file that keeps nothing and counts bytes: the size a serializer
    would need, learned without a disk (``torch.save(obj, sink)``)."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n

    def flush(self) -> None:
        pass


def temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable: the entry itself must reach the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike,
                size: Callable[[], int | None] | None = None) -> Iterator[BinaryIO]:
    """``with atomic_file(path) as f: f.write(...)``: ``path`` appears complete and
    durable when the block ends, or not at all.

    ``size()`` tells the bytes the content needs, asked only when the disk is full (a
    streamed write does not know its size in advance; the default is what was written
    before the failure, a lower bound). Raises :class:`DiskFullError` on a full disk,
    with the temporary file already removed; any other error propagates as it is.
    """
    path = Path(path)
    tmp = temporary_path(path)
    f = open(tmp, "wb")  # noqa: SIM115 - closed below on every path
    try:
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):  # ENOSPC again, flushing the buffer's tail
                f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as err:
        written = tmp.stat().st_size if tmp.exists() else 0
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, Exception) and failed_for_space(err, path.parent):
            needed = size() if size is not None else written
            raise DiskFullError(path, needed, free_bytes(path.parent)) from None
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) as the whole of ``path``, atomically and durably."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    with atomic_file(path, size=lambda: len(raw)) as f:
        f.write(raw)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line to a log; on a full disk the file is cut back to its old end (or
    removed, when this line was to create it), so readers never meet half a line."""
    path = Path(path)
    raw = (line if line.endswith("\n") else line + "\n").encode()
    existed = path.exists()
    # Unbuffered: a write that fails leaves nothing queued for close() to retry.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
        except OSError as err:
            if not failed_for_space(err, path.parent):
                raise
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
                if not existed:  # an empty log is no record of anything: none at all
                    path.unlink()
            raise DiskFullError(path, len(raw), free_bytes(path.parent)) from None
    finally:
        os.close(fd)
