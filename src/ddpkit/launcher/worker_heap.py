"""Workers keep large freed blocks in their heap instead of unmapping them (glibc).

Each backward allocates every gradient anew (``zero_grad()`` leaves ``.grad`` None), and
the engine then scales it into its bucket. Above glibc's mmap threshold (dynamic, at most
32 MiB) such an allocation is a fresh mapping whose pages fault in on first touch, and
its free unmaps it again: every step pays the page faults of all large gradients, which
makes handing a gradient to its bucket cost several times a plain memory pass
(``benchmarks/fresh_gradient.py``; figures in benchmarks/RESULTS-history.md). With the
threshold raised, freed blocks stay in the heap and the next step reuses them.

The launcher passes the two variables to the processes it starts; a process started
some other way (plain ``torchrun``, ``python script.py``) gets the same two settings
through ``mallopt`` when it builds a CPU ``DataParallel``. A user's own ``MALLOC_*`` or
``GLIBC_TUNABLES`` settings stand, and ``DDPKIT_SYSTEM_MALLOC=1`` keeps glibc's defaults.
Other C libraries ignore the variables and are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Mapping

OPT_OUT_ENV = "DDPKIT_SYSTEM_MALLOC"
# mallopt's parameter numbers for the two variables (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
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


def keep_large_blocks_here(environ: Mapping[str, str] = os.environ) -> bool:
    """Give this process the workers' settings now, unless something already decided.

    A process the launcher started has the variables (glibc read them at start-up), so
    this changes nothing there; the same goes for a user's own settings. True where the
    settings were applied here.
    """
    settings = worker_malloc_env(environ)
    if not settings or not _is_glibc():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (mallopt(M_MMAP_THRESHOLD, int(settings["MALLOC_MMAP_THRESHOLD_"])) == 1
            and mallopt(M_TRIM_THRESHOLD, int(settings["MALLOC_TRIM_THRESHOLD_"])) == 1)


def _is_glibc() -> bool:
    """mallopt's parameter numbers above are glibc's; other C libraries number them apart."""
    return platform.libc_ver()[0] == "glibc"
