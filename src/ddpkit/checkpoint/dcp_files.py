"""torch.distributed.checkpoint's own file storage, with what ddpkit adds around it.

DCP (``dcp.save`` / ``dcp.load`` with ``FileSystemWriter`` / ``FileSystemReader``) writes
one ``__R_0.distcp`` file per rank and a ``.metadata`` file last. It leaves the rest to
the caller; here:

* every file a rank writes is hashed (sha256) as its bytes pass, so the manifest can
  list each file's size and hash without reading the checkpoint a second time;
* ``.metadata`` is a pickle: it is read with an unpickler that builds only DCP's own
  metadata classes and plain values, so a planted file cannot run code;
* values that are not tensors (an optimizer's hyper-parameters) are loaded with
  ``weights_only=True`` (DCP's default planner would unpickle them freely);
* a failure on any rank, which DCP raises as a ``CheckpointException`` (a
  ``BaseException``) on every rank, becomes one line: a full disk as
  :class:`~ddpkit.files.durable.DiskFullError`, anything else as text naming the rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ddpkit.files.durable import DiskFullError, failed_for_space, free_bytes, is_disk_full

METADATA = ".metadata"  # DCP's name for the file it writes last
DATA_SUFFIX = ".distcp"


class _HashingStream(io.RawIOBase):
    """A file opened for writing that hashes what passes through (DCP asks it for
    ``tell`` and ``fileno`` as well)."""

    def __init__(self, f):
        super().__init__()
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self._f.write(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        if not self._f.closed:
            self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        super().close()  # flushes first
        self._f.close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording (bytes, sha256) of every file written, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with open(path, mode) as f:  # noqa: PTH123 - DCP hands str or Path
                stream = _HashingStream(f)
                yield stream
        except Exception as err:
            # Named here, on the rank that wrote: DCP sends each rank's failure to every
            # rank pickled, and pickling drops the ENOSPC a short write was raised from.
            if failed_for_space(err, Path(path).parent):
                raise DiskFullError(path, None, free_bytes(Path(path).parent)) from err
            raise
        with self._lock:
            self.written[Path(path).name] = (stream.size, stream.sha.hexdigest())


def hashing_writer(directory: Path) -> tuple[FileSystemWriter, dict[str, tuple[int, str]]]:
    """A ``FileSystemWriter`` into ``directory`` (fsyncs each file) and the dict it
    fills with the files this rank wrote: ``{name: (bytes, sha256)}``."""
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True,
                              overwrite=False)
    fs = _HashingFileSystem()
    writer.fs = fs
    return writer, fs.written


# ---------------------------------------------------------------------- reading
_ALLOWED_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
_ALLOWED = {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
            ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes (dataclasses and enums of torch.distributed.
    checkpoint), torch sizes, dtypes and layouts, and plain values; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` load cannot run code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with open(self._get_metadata_path(rank), "rb") as f:  # noqa: PTH123
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{METADATA} holds a {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(directory: str | os.PathLike) -> Metadata:
    """A DCP checkpoint's metadata (local, no collective)."""
    return SafeReader(directory).read_metadata()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


@contextlib.contextmanager
def dcp_quiet() -> Iterator[None]:
    """DCP warns on every save and load without a process group that it assumes one
    process (what ddpkit means there), and on every sharded tensor that ShardedTensor is
    deprecated (ddpkit's ZeRO pieces are boxes DTensor cannot describe; nothing a user
    can act on): noise, both."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor")
        yield


def failure_text(err: CheckpointException) -> tuple[str, BaseException | None]:
    """(one line naming the first failing rank and its error, the error itself)."""
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"rank {rank}: {type(exc).__name__}: {first}", exc
    return "torch.distributed.checkpoint failed", None


def disk_full_in(err: CheckpointException) -> bool:
    return any(is_disk_full(f[0] if isinstance(f, tuple) else f)
               for f in err.failures.values())
