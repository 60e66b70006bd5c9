"""A rank-aware logger: rank 0 speaks by default, every line says which rank it is.

With N processes writing to one terminal, unprefixed output from every rank is noise.
``get_logger`` returns an adapter that drops records on non-zero ranks unless the call
passes ``all_ranks=True``, prefixes ``[rank N]``, and offers ``warning_once``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # Before init the launcher's variable is the only source of truth.
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)


class RankLogger(logging.LoggerAdapter):
    def log(self, level, msg, *args, all_ranks: bool = False, **kwargs):  # type: ignore[override]
        if not self.isEnabledFor(level):
            return
        rank = _rank()
        if rank != 0 and not all_ranks:
            return
        self.logger.log(level, f"[rank {rank}] {msg}", *args, **kwargs)

    def debug(self, msg, *args, **kwargs):
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg, *args, **kwargs):
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg, *args, **kwargs):
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg, *args, **kwargs):
        self.log(logging.ERROR, msg, *args, **kwargs)

    @functools.cache  # noqa: B019 - one warning per (logger, message) is the point
    def warning_once(self, msg: str, all_ranks: bool = False) -> None:
        self.warning(msg, all_ranks=all_ranks)


def get_logger(name: str = "ddpkit") -> RankLogger:
    logger = logging.getLogger(name)
    root = logging.getLogger("ddpkit")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("DDPKIT_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return RankLogger(logger, {})
