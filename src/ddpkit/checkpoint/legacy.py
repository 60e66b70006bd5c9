"""Format 1 checkpoints (``ddpkit-checkpoint/1``), written before checkpoints became DCP
directories: still listed, verified, loaded and rotated, never written.

A format 1 checkpoint is ``step_N.pt`` (one ``torch.save`` payload by rank 0) committed
by ``step_N.json`` beside it (its size and sha256); a sharded optimizer's parts are
``step_N.rankRRRRR-of-WWWWW.pt``, one per rank, listed in the manifest's ``shards``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ddpkit.checkpoint.common import CheckpointInfo, _sha256_file

FORMAT = "ddpkit-checkpoint/1"
NAME = re.compile(r"^step_(\d{9})\.(pt|json)$")
SHARD_NAME = re.compile(r"^step_(\d{9})\.rank(\d{5})-of-(\d{5})\.pt$")


def payload(directory: Path, step: int) -> Path:
    return directory / f"step_{step:09d}.pt"


def manifest_of(path: Path) -> Path:
    return path.with_suffix(".json")


def steps(directory: Path) -> set[int]:
    """Steps with a format 1 payload or manifest in ``directory``."""
    return {int(m.group(1)) for p in directory.iterdir() if (m := NAME.match(p.name))}


def parse_manifest(path: Path, text: str, step_of_name: int) -> CheckpointInfo | str:
    """The manifest text of payload ``path``, or what is wrong with it (both formats
    share the wording)."""
    manifest = manifest_of(path) if path.suffix == ".pt" else path / "manifest.json"
    try:
        meta = json.loads(text)
        info = CheckpointInfo(
            path=path,
            step=int(meta["step"]),
            size=int(meta.get("bytes", 0)),
            sha256=str(meta.get("sha256", "")),
            world_size=meta.get("world_size"),
            reason=str(meta.get("reason", "periodic")),
            saved_at=float(meta.get("saved_at", 0.0)),
            meta=dict(meta.get("meta") or {}),
            shards=tuple((str(e["file"]), int(e["bytes"]), str(e["sha256"]))
                         for e in meta.get("shards", ())),
            files=tuple((str(name), int(e["bytes"]), str(e["sha256"]))
                        for name, e in (meta.get("files") or {}).items()),
        )
        if path.suffix == ".pt" and "bytes" not in meta:
            raise KeyError("bytes")
        if path.suffix != ".pt" and not info.files:  # a directory's manifest lists them
            raise KeyError("files")
    except ValueError as err:
        what = "empty" if not text.strip() else f"not valid JSON ({err})"
        return f"its manifest {manifest.name} is damaged: truncated or corrupt, {what}"
    except (KeyError, TypeError, AttributeError) as err:
        return f"its manifest {manifest.name} is damaged: no valid field {err}"
    if info.step != step_of_name:
        return f"its manifest {manifest.name} describes step {info.step}, not this file"
    return info


def read_manifest(path: Path, step: int) -> CheckpointInfo | str:
    manifest = manifest_of(path)
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        return (f"its manifest {manifest.name} is missing: the write stopped before its "
                "commit, or the manifest was deleted")
    except (OSError, UnicodeDecodeError) as err:
        return f"its manifest {manifest.name} cannot be read ({err})"
    return parse_manifest(path, text, step)


def verify(info: CheckpointInfo) -> str | None:
    """Why a format 1 payload (and its per-rank files) cannot be trusted, or None."""
    try:
        actual_size = info.path.stat().st_size
    except OSError:
        return (f"the payload file is missing (its manifest "
                f"{manifest_of(info.path).name} is there): deleted or moved")
    if actual_size < info.size:
        return f"truncated: {actual_size} bytes, its manifest says {info.size}"
    if actual_size > info.size:
        return f"overwritten: {actual_size} bytes, its manifest says {info.size}"
    digest, _ = _sha256_file(info.path)
    if digest != info.sha256:
        return "sha256 mismatch: its bytes changed after it was written (corrupt)"
    for name, size, sha in info.shards:
        shard = info.path.parent / name
        try:
            actual_size = shard.stat().st_size
        except OSError:
            return f"per-rank file {name} is missing"
        if actual_size != size or _sha256_file(shard)[0] != sha:
            return f"per-rank file {name} is truncated or corrupt"
    return None


def remove(directory: Path, step: int, info: CheckpointInfo | None = None) -> None:
    """Uncommit (manifest first), then remove a format 1 checkpoint and its rank files."""
    path = payload(directory, step)
    manifest_of(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    for name, _size, _sha in (info.shards if info is not None else ()):
        (directory / name).unlink(missing_ok=True)


def remove_orphan_rank_files(directory: Path, before_step: int) -> None:
    """Per-rank files of format 1 checkpoints never committed, older than a step."""
    for entry in directory.iterdir():
        found = SHARD_NAME.match(entry.name)
        if found and int(found.group(1)) < before_step and not manifest_of(
                payload(directory, int(found.group(1)))).exists():
            entry.unlink(missing_ok=True)
