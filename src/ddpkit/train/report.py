"""What a run leaves behind: a fresh run directory, the summary, the weights, the plot
(the metrics log is :mod:`ddpkit.loop.metrics_log`'s).

Only rank 0 calls these. A run directory is never reused: its name is a timestamp plus a
counter, created with ``exist_ok=False`` so two runs started in the same second (or on a
shared file system) each get their own. Every file is written through
:mod:`ddpkit.files.durable`: complete or absent, never half of one, and a full disk is a
:class:`~ddpkit.files.durable.DiskFullError` naming the file and the bytes it needs.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.files.durable import CountingSink, atomic_file, write_atomic
from ddpkit.files.jsonfiles import json_safe

SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.json"
PLOT_FILE = "curves.png"
MODEL_FILE = "model.pt"  # the final unwrapped state_dict, for users of the trained model
CHECKPOINT_DIR = "checkpoints"


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` if needed and make sure we can write there (before any process starts)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out-dir {out}: cannot create it ({exc.strerror})") from None
    if not out.is_dir():
        raise ConfigError(f"--out-dir {out} exists and is not a directory")
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out-dir {out} is not writable; choose another with --out-dir")
    return out


def new_run_dir(out_dir: str | os.PathLike, tag: str) -> Path:
    out = check_out_dir(out_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = out / (f"{stamp}-{tag}" if n == 0 else f"{stamp}-{tag}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise ConfigError(f"--out-dir {out}: could not find a free run directory name")


def save_model(state: dict[str, Any], path: Path) -> None:
    """The trained weights, loadable with ``torch.load(path, weights_only=True)``;
    durable (fsync'd) when this returns."""
    import torch

    def size() -> int:
        sink = CountingSink()
        torch.save(state, sink)
        return sink.size

    with atomic_file(path, size=size) as f:
        torch.save(state, f)


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(json_safe(data), indent=2, sort_keys=True) + "\n")


def plot_curves(history: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Loss and accuracy per epoch, train and test, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for split, style in (("train", "-o"), ("test", "--s")):
        ax_loss.plot(epochs, [h[f"{split}_loss"] for h in history], style, label=split, ms=3)
        ax_acc.plot(epochs, [100 * h[f"{split}_acc"] for h in history], style, label=split, ms=3)
    ax_loss.set(xlabel="epoch", ylabel="loss (mean per sample)", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    image = io.BytesIO()  # rendered first: a full disk leaves no half-written PNG
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    write_atomic(path, image.getvalue())
    return path
