"""What the fault tests and the chaos run (benchmarks/chaos.py) share: how to damage a
checkpoint, how to find every process of one run, its shared-memory segments and its
listening sockets, and a small filesystem to fill up.

A run is tagged by a marker variable in its environment (:data:`MARKER`): the launcher
passes its environment to the agent's workers and they to theirs, so whatever is left
of a run after a fault, reparented or not, is found by reading ``/proc/<pid>/environ``,
without touching the other jobs on a shared machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "DDPKIT_CHAOS_RUN"


# ---------------------------------------------------------------------- damage
DATA = "__0_0.distcp"  # rank 0's DCP data file: a checkpoint's bulk


def _files(ckpt: Path, step: int) -> tuple[Path, Path]:
    """(a step's checkpoint directory, its manifest)."""
    directory = ckpt / f"step_{step:09d}"
    return directory, directory / "manifest.json"


def _data(ckpt: Path, step: int, name: str = DATA) -> Path:
    return _files(ckpt, step)[0] / name


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _debris(ckpt: Path, step: int) -> None:
    """What a writer killed mid-save leaves: a hidden directory, DCP's metadata and all."""
    debris = ckpt / f".step_{step:09d}.tmp-99999"
    debris.mkdir()
    (debris / ".metadata").write_bytes(b"half")
    (debris / DATA).write_bytes(b"half")


@dataclass(frozen=True)
class Damage:
    """One way the newest checkpoint gets damaged, and the words that must name it
    (a regular expression; ``{payload}`` (the step's directory), ``{manifest}``,
    ``{older}`` filled in)."""

    name: str
    apply: Callable[[Path, int, int], None]  # (checkpoint dir, newest step, older step)
    says: str
    falls_back: bool = True  # False: the newest checkpoint is still the one to use


_FILE = r"{payload}: its file " + re.escape(DATA)
DAMAGES = [
    Damage("flipped byte in the DCP data",
           lambda d, new, old: _flip(_data(d, new)),
           _FILE + r" has a sha256 mismatch: its bytes changed after it was written"),
    Damage("DCP data truncated",
           lambda d, new, old: _data(d, new).write_bytes(_data(d, new).read_bytes()[:-10]),
           _FILE + r" is truncated: \d+ bytes, its manifest says \d+"),
    Damage("DCP data emptied",
           lambda d, new, old: _data(d, new).write_bytes(b""),
           _FILE + r" is truncated: 0 bytes, its manifest says \d+"),
    Damage("DCP data deleted, manifest kept",
           lambda d, new, old: _data(d, new).unlink(),
           _FILE + r" is missing \(deleted or moved\)"),
    Damage("DCP data replaced by garbage of its size",
           lambda d, new, old: _data(d, new).write_bytes(os.urandom(_data(d, new).stat().st_size)),
           _FILE + r" has a sha256 mismatch"),
    Damage("older DCP data copied over it",
           lambda d, new, old: shutil.copyfile(_data(d, old), _data(d, new)),
           _FILE + r" (has a sha256 mismatch|is truncated|is overwritten)"),
    Damage("DCP metadata deleted",
           lambda d, new, old: _data(d, new, ".metadata").unlink(),
           r"{payload}: its file \.metadata is missing"),
    Damage("run state flipped",
           lambda d, new, old: _flip(_data(d, new, "run.pt")),
           r"{payload}: its file run\.pt has a sha256 mismatch"),
    Damage("manifest deleted",
           lambda d, new, old: _files(d, new)[1].unlink(),
           r"{payload}: its manifest {manifest} is missing \(deleted\)"),
    Damage("manifest truncated",
           lambda d, new, old: _files(d, new)[1].write_text(_files(d, new)[1].read_text()[:40]),
           r"{payload}: its manifest {manifest} is damaged: truncated or corrupt, not valid JSON"),
    Damage("manifest emptied",
           lambda d, new, old: _files(d, new)[1].write_text(""),
           r"{payload}: its manifest {manifest} is damaged: truncated or corrupt, empty"),
    Damage("older manifest copied over it",
           lambda d, new, old: shutil.copyfile(_files(d, old)[1], _files(d, new)[1]),
           r"{payload}: its manifest {manifest} describes step {older}, not this file"),
    Damage("debris of an interrupted write beside it",
           lambda d, new, old: _debris(d, new + 1),
           r"", falls_back=False),
]


def words_for(damage: Damage, ckpt: Path, newest: int, older: int) -> str:
    payload, manifest = _files(ckpt, newest)
    return damage.says.format(payload=re.escape(str(payload)), manifest=re.escape(manifest.name),
                              older=older)


def damage_everything(ckpt: Path) -> None:
    """Every checkpoint's data overwritten: nothing left to fall back to."""
    for step_dir in ckpt.glob("step_*"):
        (step_dir / DATA).write_bytes(b"garbage")


# ---------------------------------------------------------------------- processes
def marked(marker: str) -> list[int]:
    """Pids of live processes (zombies aside) whose environment carries ``marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            stat = (entry / "stat").read_text()
            if stat[stat.rfind(")") + 2] != "Z":
                found.append(int(entry.name))
    return found


def environ(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
    return {}


def worker_pid(marker: str, rank: int) -> int | None:
    """The live worker of global rank ``rank`` in the run tagged ``marker``."""
    for pid in marked(marker):
        env = environ(pid)
        if env.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in env:
            return pid
    return None


def seconds_until_gone(marker: str, limit: float) -> float | None:
    """Seconds until no process of the run is left, or None if some outlive ``limit``
    (those are then killed, so that one failure does not spill into the next run)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if not marked(marker):
            return time.monotonic() - start
        time.sleep(0.05)
    for pid in marked(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    return None


@dataclass
class Watch:
    """Every pid the run ever had and every TCP port its processes listened on, sampled
    in the background while it runs."""

    marker: str
    pids: set[int] = field(default_factory=set)
    listening: set[str] = field(default_factory=set)  # "address:port"
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            pids = marked(self.marker)
            self.pids.update(pids)
            self.listening.update(listening_sockets(pids))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def hex_address(text: str) -> str:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in raw[::-1])
    else:  # /proc/net/tcp6: four little-endian 32-bit words
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        ip = ":".join(b"".join(words).hex()[i:i + 4] for i in range(0, 32, 4))
    return f"{ip}:{int(port, 16)}"


def listening_sockets(pids: list[int]) -> set[str]:
    """"address:port" of each TCP socket in LISTEN state that one of ``pids`` holds
    (from /proc/net/tcp and tcp6: IPv6 addresses as 8 groups of 4 hex digits)."""
    inodes = set().union(*(_socket_inodes(p) for p in pids)) if pids else set()
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    found.add(hex_address(cols[1]))
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("0000:0000:0000:0000:0000:0000:0000:0001",
                                                "0000:0000:0000:0000:0000:ffff:7f00:0001")


SHM_DIR = Path("/dev/shm")


def leaked_segments(pids: set[int]) -> list[str]:
    """Shared-memory segments left in /dev/shm by any of ``pids`` (their names carry the
    creator's pid: ddpkit-shm-<run>-<pid>-...)."""
    left = []
    for path in SHM_DIR.glob("ddpkit-shm-*"):
        numbers = [int(part) for part in path.name.split("-") if part.isdigit()]
        if any(n in pids for n in numbers):
            left.append(path.name)
    return left


# ---------------------------------------------------------------------- a disk to fill
@contextlib.contextmanager
def small_filesystem(size_mib: int = 16, *, size_kib: int | None = None) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` (or ``size_kib``) mounted on a fresh directory (needs root),
    unmounted after. Raises ``OSError`` when the mount is refused (no CAP_SYS_ADMIN)."""
    where = Path(tempfile.mkdtemp(prefix="ddpkit-full-"))
    size = f"{size_kib}k" if size_kib is not None else f"{size_mib}m"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                              str(where)], check=False, capture_output=True, text=True)
    if mounted.returncode != 0:
        where.rmdir()
        raise OSError(f"mount -t tmpfs refused: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()


@contextlib.contextmanager
def small_filesystem_or_skip(size_kib: int) -> Iterator[Path]:
    """:func:`small_filesystem` of ``size_kib``; where no tmpfs can be mounted (not root,
    no CAP_SYS_ADMIN) the test is skipped, or fails under DDPKIT_REQUIRE_ALL=1."""
    from conftest import skip_unless_required

    with contextlib.ExitStack() as stack:
        try:
            where = stack.enter_context(small_filesystem(size_kib=size_kib))
        except OSError as err:
            skip_unless_required(f"needs a small tmpfs: {err}")
        yield where


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


PAGE = 4096


def fill(where: Path, leave: int = 0) -> Path:
    """Take all the free space of ``where``'s filesystem but ``leave`` bytes (rounded
    down to whole pages, tmpfs's unit). Returns the filler file: remove it to free."""
    filler = where / "filler"
    st = os.statvfs(where)
    take = st.f_bavail * st.f_frsize - (leave // PAGE) * PAGE
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if take > 0:
            os.posix_fallocate(fd, 0, take)
    finally:
        os.close(fd)
    return filler


def pages(nbytes: int) -> int:
    """Bytes a file of ``nbytes`` takes on tmpfs."""
    return -(-nbytes // PAGE) * PAGE


FRAME_DUMP = re.compile(r"^\s*frame #\d+:", re.MULTILINE)
