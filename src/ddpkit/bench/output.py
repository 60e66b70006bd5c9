"""What every benchmark writes besides its table: CSV, JSON and a PNG plot.

The formats are the ones the published results were written in (see
benchmarks/RESULTS.md), so each harness passes its own float format and line ending.
"""

from __future__ import annotations

import csv
import json


def write_csv(path: str, rows: list[dict], *, value=str, lineterminator: str = "\r\n") -> str:
    """A header from the first row's keys, then one line per row (``value`` formats cells)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator=lineterminator)
        writer.writerow(list(rows[0]) if rows else [])
        for row in rows:
            writer.writerow([value(v) for v in row.values()])
    return path


def save_json(path: str, data, *, indent: int, final_newline: bool) -> str:
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
        if final_newline:
            f.write("\n")
    return path


def pyplot():
    """matplotlib.pyplot on the file-only backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, axes, path: str, dpi: int) -> str:
    """Grid and legend on every axis, then write ``path`` and free the figure."""
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
