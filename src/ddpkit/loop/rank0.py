"""Rank 0 decides, every rank learns the decision, or every rank raises rank 0's error.

A run directory is created (and named) on rank 0 only; the other ranks must learn its
name, and when rank 0 cannot create it they must fail with the same one-line error
instead of waiting in their next collective for a rank that has left.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from ddpkit.errors import ConfigError


def decide_on_rank0(decide: Callable[[], str | None], *, is_main: bool,
                    world_size: int) -> str | None:
    """Collective: ``decide()`` runs on rank 0 and its result reaches every rank.

    A :class:`ConfigError` raised by ``decide`` is raised on every rank (with rank 0's
    message); other ranks never call ``decide``. Without a process group (one process)
    it is just ``decide()`` on rank 0.
    """
    proposal: list[str | None] = [None, None]
    if is_main:
        try:
            proposal[0] = decide()
        except ConfigError as err:
            proposal[1] = str(err)
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(proposal, src=0)
    if proposal[1] is not None:
        raise ConfigError(proposal[1])
    return proposal[0]


def cannot_create(path, err: OSError) -> ConfigError:
    """The one-line error for a run directory the OS refused to create."""
    return ConfigError(f"run directory {path}: cannot create it ({err.strerror or err})")
