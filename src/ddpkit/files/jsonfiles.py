"""JSON that readers never choke on: no NaN/inf. Shared by the training application's
reports and the library's metric log (torch-free, so the launcher can use it before any
worker starts); files are written atomically by :mod:`ddpkit.files.durable`."""

from __future__ import annotations

import math
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

