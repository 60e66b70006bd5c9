"""Which samples each rank trained on, step by step: proof that none is lost or repeated.

With ``log_sample_ids`` (``ddpkit train --log-sample-ids``, ``Run(log_sample_ids=True)``)
every rank appends one JSON line per optimizer step to
``<run dir>/sample_ids/rank<r>.jsonl``::

    {"step": 13, "epoch": 1, "rank": 0, "ids": [812, 5, ...]}

``step`` counts optimizer steps from the start of the run (1 = the first step), ``ids``
are the real samples of that rank's share of the step (padding left out).

Replay after a resume: the steps after the checkpoint a run resumes from are trained
again, so their old lines are superseded. On every start from a checkpoint rank 0
rewrites each file keeping only lines with ``step <=`` the checkpoint's step (and
drops a line cut short by a crash) before any rank trains. The files then always
describe exactly the steps that produced the current model, and over a whole epoch the
ids of all ranks' files are every sample of the data set once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddpkit.files.durable import DiskFullError, append_line, write_atomic

SAMPLE_DIR = "sample_ids"


class SampleLog:
    """One rank's append-only log; a line reaches the OS as soon as it is written, so a
    process killed later cannot take it along, and a full disk leaves no half line
    (:func:`ddpkit.files.durable.append_line`)."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.path = Path(run_dir) / SAMPLE_DIR / f"rank{rank}.jsonl"
        self.rank = rank

    def write(self, step: int, epoch: int, ids: Iterable[int]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": step, "epoch": epoch, "rank": self.rank, "ids": list(ids)}
        append_line(self.path, json.dumps(record))

    def close(self) -> None:
        pass  # every line is written whole, file closed, as it comes

    def write_agreed(self, step: int, epoch: int, ids: Iterable[int], world_size: int,
                     device: Any) -> None:
        """Collective: :meth:`write` on every rank; a full disk on any rank raises its
        :class:`~ddpkit.files.durable.DiskFullError` on every rank, so that all end alike on
        one line, instead of the others failing on a peer that left. A one-integer
        all-reduce per step (only when the ids are logged); the error itself crosses
        only when there is one."""
        import torch
        import torch.distributed as dist

        failure: DiskFullError | None = None
        try:
            self.write(step, epoch, ids)
        except DiskFullError as err:
            failure = err
        if dist.is_available() and dist.is_initialized() and world_size > 1:
            flag = torch.tensor([int(failure is not None)], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                told: list[DiskFullError | None] = [None] * world_size
                dist.all_gather_object(told, failure)
                failure = next(f for f in told if f is not None)
        if failure is not None:
            raise failure


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a process killed mid-write
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out


def truncate_sample_logs(run_dir: str | os.PathLike, step: int) -> None:
    """Keep only the lines of steps ``<= step`` in every rank's file (rank 0 only)."""
    directory = Path(run_dir) / SAMPLE_DIR
    if not directory.is_dir():
        return
    for path in sorted(directory.glob("rank*.jsonl")):
        kept = [r for r in _records(path) if r["step"] <= step]
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def read_sample_logs(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every rank's records, ordered by (step, rank)."""
    directory = Path(run_dir) / SAMPLE_DIR
    records = [r for path in sorted(directory.glob("rank*.jsonl")) for r in _records(path)]
    return sorted(records, key=lambda r: (r["step"], r["rank"]))
