"""JSON written so that readers never choke on it: no NaN/inf, no half-written file.
Shared by the training application's reports and the library's metric log (torch-free,
so the launcher can use it before any worker starts)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


def json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null instead of producing invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write-then-rename: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
