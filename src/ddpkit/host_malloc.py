"""Workers keep large freed blocks in their heap instead of unmapping them (glibc).

Each backward allocates every gradient anew (``zero_grad()`` leaves ``.grad`` None), and
the engine then scales it into its bucket. Above glibc's mmap threshold (dynamic, at most
32 MiB) such an allocation is a fresh mapping whose pages fault in on first touch, and
its free unmaps it again: every step pays the page faults of all large gradients, which
makes handing a gradient to its bucket cost several times a plain memory pass
(``benchmarks/fresh_gradient.py``; figures in benchmarks/RESULTS.md). With the
threshold raised, freed blocks stay in the heap and the next step reuses them.

The launcher passes the two variables to the processes it starts; a user's own
``MALLOC_*`` or ``GLIBC_TUNABLES`` settings stand, and ``DDPKIT_SYSTEM_MALLOC=1``
keeps glibc's defaults. Other C libraries ignore the variables.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

OPT_OUT_ENV = "DDPKIT_SYSTEM_MALLOC"
KEEP_LARGE_BLOCKS = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),  # blocks below 1 GiB come from the heap
    "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1),  # and the heap is not trimmed after them
}


def worker_malloc_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables to give worker processes (empty where the user decides)."""
    if sys.platform != "linux" or environ.get(OPT_OUT_ENV) == "1":
        return {}
    if "GLIBC_TUNABLES" in environ or any(k.startswith("MALLOC_") for k in environ):
        return {}
    return dict(KEEP_LARGE_BLOCKS)
