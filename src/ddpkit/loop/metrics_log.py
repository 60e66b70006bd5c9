"""Per-step metric records, written by rank 0: JSON lines always, CSV and TensorBoard
on request.

``<run dir>/metrics.jsonl`` gets one JSON object per record; every record has a
``step``. ``csv`` adds ``metrics.csv`` (one row per record; the header is the union of
the keys seen, rewritten when a new key appears), ``tensorboard`` adds event files
under ``tb/`` (needs the optional ``tensorboard`` package: ``pip install
'ddpkit[tensorboard]'``).

Replay after a resume: the steps after the checkpoint are trained again, so their old
records go. :func:`truncate_records` keeps the records of steps ``<=`` the
checkpoint's step (and drops a line cut short by a crash); TensorBoard is told the same
with ``purge_step``.

This module is the one writer and the one reader of ``metrics.jsonl``: ``ddpkit.Run``
writes its per-step records and ``ddpkit train``'s epoch records through
:class:`MetricLog`; every file goes through :mod:`ddpkit.files.durable` (appends that never
leave half a line, rewrites that are atomic and fsync'd).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import resource
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.files.durable import append_line, write_atomic
from ddpkit.files.jsonfiles import json_safe


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (records carry every rank's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mean_over_ranks(values: Mapping[str, Any], rank: int, world_size: int,
                    device: Any) -> dict[str, Any]:
    """Collective: the mean over ranks of each of ``values`` (floats or 0-dim tensors,
    the same names on every rank) and every rank's peak RSS (``rank_peak_rss_mib``)."""
    import torch
    import torch.distributed as dist

    names = sorted(values)
    # One float64 all-reduce for all of them: the record costs one collective. Each
    # rank's peak memory rides in its own slot after them, so the sum lists them all.
    vals = torch.zeros(len(names) + world_size, dtype=torch.float64, device=device)
    for i, n in enumerate(names):
        vals[i] = torch.as_tensor(values[n]).detach().to(device, torch.float64).reshape(())
    vals[len(names) + rank] = peak_rss_mib()
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        dist.all_reduce(vals)
    totals = vals.tolist()
    out: dict[str, Any] = dict(zip(names, (v / world_size for v in totals[:len(names)]),
                                   strict=True))
    out["rank_peak_rss_mib"] = [round(v) for v in totals[len(names):]]
    return out


JSONL_FILE = "metrics.jsonl"
CSV_FILE = "metrics.csv"
TB_DIR = "tb"
WRITERS = ("jsonl", "csv", "tensorboard")


def check_writers(log_with: Iterable[str]) -> tuple[str, ...]:
    """The writers asked for, checked before any process does work (jsonl is implied)."""
    names = [w.strip() for w in log_with if w.strip()]
    unknown = [w for w in names if w not in WRITERS]
    if unknown:
        raise ConfigError(f"unknown metric writer(s) {unknown}; choose from {', '.join(WRITERS)}")
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging to tensorboard needs the tensorboard package; install it "
                          "with: pip install 'ddpkit[tensorboard]' (or log with csv)")
    return tuple(dict.fromkeys(["jsonl", *names]))


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, skipping a line cut short by a crash."""
    out = []
    path = Path(path)
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def truncate_records(run_dir: str | os.PathLike, step: int) -> None:
    """Keep the records of steps ``<= step`` in metrics.jsonl and metrics.csv."""
    run_dir = Path(run_dir)
    jsonl = run_dir / JSONL_FILE
    if jsonl.exists():
        # A record without a step is a leftover of something else: it goes too.
        kept = [r for r in read_records(jsonl) if int(r.get("step", step + 1)) <= step]
        write_atomic(jsonl, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    table = run_dir / CSV_FILE
    if table.exists():
        with table.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        fields = list(rows[0].keys()) if rows else []
        kept_rows = [r for r in rows if r.get("step") and int(float(r["step"])) <= step]
        _write_csv(table, fields, kept_rows)


def _csv_text(fields: list[str], rows: list[Mapping[str, Any]], header: bool = True) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, restval="")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _write_csv(path: Path, fields: list[str], rows: list[Mapping[str, Any]]) -> None:
    write_atomic(path, _csv_text(fields, rows))


class MetricLog:
    """Rank 0's writers for one run directory. ``start_step``: the step the run resumed
    from (0 for a fresh run); records of later steps are replaced as they are replayed."""

    def __init__(self, run_dir: str | os.PathLike, log_with: Iterable[str] = ("jsonl",),
                 start_step: int = 0):
        self.dir = Path(run_dir)
        self.writers = check_writers(log_with)
        self._csv_fields: list[str] | None = None
        self._tb = None
        if "tensorboard" in self.writers:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events of the steps being replayed are dropped from the view.
            self._tb = SummaryWriter(str(self.dir / TB_DIR), purge_step=start_step + 1)

    def write(self, record: Mapping[str, Any], *, jsonl_only: bool = False) -> None:
        """Append ``record`` (it has a ``step``) to every writer; ``jsonl_only``: to
        metrics.jsonl alone (``ddpkit train``'s epoch records, which hold lists)."""
        record = json_safe(dict(record))
        self.dir.mkdir(parents=True, exist_ok=True)
        append_line(self.dir / JSONL_FILE, json.dumps(record, sort_keys=True))
        if jsonl_only:
            return
        if "csv" in self.writers:
            self._write_csv(record)
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def _write_csv(self, record: dict[str, Any]) -> None:
        path = self.dir / CSV_FILE
        if self._csv_fields is None and path.exists():
            with path.open(newline="") as fh:
                self._csv_fields = next(csv.reader(fh), [])
        fields = self._csv_fields or []
        scalars = {k: v for k, v in record.items() if not isinstance(v, (list, dict))}
        new = [k for k in scalars if k not in fields]
        if new or not path.exists():
            # A key no row had yet: rewrite the file with the wider header (rare).
            rows: list[dict[str, Any]] = []
            if path.exists():
                with path.open(newline="") as fh:
                    rows = list(csv.DictReader(fh))
            fields = fields + sorted(new)
            _write_csv(path, fields, [*rows, scalars])
            self._csv_fields = fields
            return
        append_line(path, _csv_text(fields, [scalars], header=False))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
