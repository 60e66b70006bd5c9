"""Default output directories of the commands: stamped with the time, never one that exists.

Two commands started in the same second (a script, a docs check) must not collide and
refuse each other's directory, so a taken name gets a counter instead.
"""

from __future__ import annotations

import os
import time


def fresh_dir(prefix: str) -> str:
    """``<prefix>-<YYYYmmdd-HHMMSS>``, or with ``-2``, ``-3``... when that name is taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = f"{prefix}-{stamp}", 1
    while os.path.exists(path):
        n += 1
        path = f"{prefix}-{stamp}-{n}"
    return path
