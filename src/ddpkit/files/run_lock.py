"""One writer per run directory: a lock that names its holder.

Two jobs writing checkpoints into one run directory (a ``--resume`` started while the
first job still runs, a scheduler's rerun racing a job it thought dead) overwrite each
other's checkpoints and logs. The job that writes holds an exclusive ``flock`` on
``<run dir>/.ddpkit-lock`` and writes its host, pid and start time into it; a second
job finds the lock taken and stops with one line that names the holder.

The kernel drops a ``flock`` when its holder dies, however it dies (SIGKILL included),
so a stale lock file left by a dead holder is simply taken over. Over NFS the lock is
held by the server's lock manager, which is what makes it work across hosts.

``ddpkit train`` takes the lock in its launcher, before any worker starts, and tells
its workers so (:data:`HOLDER_ENV`); a worker that no ddpkit launcher vouches for
(torchrun, srun, mpirun, a multi-node run whose launchers cannot all hold it) takes it
itself on rank 0. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ddpkit.errors import ConfigError

LOCK_FILE = ".ddpkit-lock"
HOLDER_ENV = "DDPKIT_RUN_LOCK"  # "<pid>:<run dir>": that launcher holds the lock for us


class RunDirInUse(ConfigError):
    """Another job holds the run directory's lock."""


class RunLock:
    """The lock of one run directory, held until :meth:`release` or process exit."""

    def __init__(self, run_dir: str | os.PathLike, fd: int):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike, command: str = "ddpkit train") -> RunLock:
        """Take the lock of ``run_dir`` (which must exist) or raise :class:`RunDirInUse`."""
        path = Path(run_dir) / LOCK_FILE
        for _ in range(10):  # another process may remove the file between open and flock
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise ConfigError(f"run directory {run_dir}: cannot create its lock file "
                                  f"{LOCK_FILE} ({err.strerror or err})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise RunDirInUse(_in_use(run_dir, _read_holder(path))) from None
            if _same_file(fd, path):
                break
            os.close(fd)  # we locked a file its holder unlinked on release: take the new one
        else:
            raise RunDirInUse(f"run directory {run_dir}: its lock file keeps changing; is "
                              "another job starting there right now?")
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        with contextlib.suppress(OSError):  # who holds it is a courtesy; a full disk may refuse it
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(holder) + "\n").encode())
        return cls(run_dir, fd)

    def release(self) -> None:
        """Give the lock up and remove the file (unlinked while still held, so nobody
        takes over a file that is about to disappear)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def vouch(self) -> dict[str, str]:
        """The environment that tells this process's workers it holds the lock for them."""
        return {HOLDER_ENV: f"{os.getpid()}:{self.run_dir.resolve()}"}

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def held_for_us(run_dir: str | os.PathLike) -> bool:
    """Whether the launcher that started this process holds ``run_dir``'s lock."""
    pid, _, path = os.environ.get(HOLDER_ENV, "").partition(":")
    return (pid.isdigit() and int(pid) == os.getppid()
            and path == str(Path(run_dir).resolve()))


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read_holder(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        holder = json.loads(path.read_text() or "{}")
        if isinstance(holder, dict):
            return holder
    return {}


def _in_use(run_dir: str | os.PathLike, holder: dict) -> str:
    who = (f"{holder.get('command', 'another job')} (pid {holder.get('pid', '?')} on host "
           f"{holder.get('host', '?')}, since {holder.get('since', '?')})")
    return (f"run directory {run_dir} is in use by {who}; two jobs writing there would "
            "overwrite each other's checkpoints: wait for it to end, or stop it first")
