"""ddpkit's own DataParallel options, checked together, in one place.

``comm``, ``comm_hook``, the bucket caps, ``initial_bucketing``, ``shard``, ``exact``
and ``slices`` each choose part of the engine, and some combinations mean nothing (a
comm hook under ZeRO, which reduce-scatters itself; exact mode, which sums itself,
with either). :func:`check_options` refuses those in one line each, before anything is
communicated, and returns the :class:`EngineOptions` DataParallel builds its engine
from (and a pickled copy builds it again from). torch's own constructor arguments are
mapped in :mod:`ddpkit.parallel.compat.torch_compat` first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.errors import ConfigError, ConfigTypeError
from ddpkit.parallel.engine.buckets import size_limits
from ddpkit.parallel.engine.interfaces import CommHook
from ddpkit.parallel.zero.sharding import check_mode
from ddpkit.vocabulary import COMM_CHOICES

INITIAL_BUCKETINGS = ("reverse", "single")


@dataclass(frozen=True)
class EngineOptions:
    """What the engine is built from (see DataParallel's docstring for each)."""

    comm: str  # one of COMM_CHOICES; "backend" when a comm hook reduces the buckets
    comm_hook: CommHook | None
    comm_state: object
    limits: tuple[int, ...]  # bucket size caps in bytes: the first bucket's, then the rest
    initial_bucketing: str
    shard: str
    exact: bool
    slices: int | None


def check_options(*, bucket_cap_mb: float, cap_given: bool, first_bucket_cap_mb: float | None,
                  comm: str | CommHook, comm_hook: CommHook | None, comm_state: object,
                  initial_bucketing: str, shard: str, exact: bool,
                  slices: int | None) -> EngineOptions:
    """The options, checked (``cap_given``: the user passed ``bucket_cap_mb``)."""
    if comm_hook is not None and not callable(comm_hook):
        raise ConfigTypeError(
            f"comm_hook must be callable as hook(state, bucket), got {comm_hook!r}")
    if callable(comm):
        if comm_hook is not None:
            raise ConfigError("pass the comm hook once: comm=hook or comm_hook=hook")
        comm_hook, comm = comm, "backend"
    elif comm not in COMM_CHOICES:
        raise ConfigError(f"comm must be one of {', '.join(COMM_CHOICES)} or a "
                          f"comm hook, got {comm!r}")
    elif comm_hook is not None and comm != "auto":
        raise ConfigError(f"comm={comm!r} and comm_hook both choose how buckets are "
                          "reduced; pass one of them")
    if first_bucket_cap_mb is None and cap_given:
        # torch 2.13: a bucket_cap_mb given by the user caps the first bucket too
        # (the smaller first bucket is part of the default only)
        first_bucket_cap_mb = bucket_cap_mb
    try:
        limits = size_limits(bucket_cap_mb, first_bucket_cap_mb)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_mode(shard)
    if exact and shard != "none":
        raise ConfigError(f"exact mode sums whole gradients on every rank; shard={shard!r} "
                          "does not combine with it (use shard='none')")
    if slices is not None and not exact:
        raise ConfigError("slices is exact mode's: DataParallel(model, exact=True, "
                          "slices=V)")
    if shard != "none" and comm_hook is not None:
        raise ConfigError(f"shard={shard!r} reduce-scatters the buckets itself; a comm hook "
                          "needs shard='none'")
    if exact and comm_hook is not None:
        raise ConfigError("exact mode sums gradients itself; pass no comm hook")
    if initial_bucketing not in INITIAL_BUCKETINGS:
        raise ConfigError(
            f"initial_bucketing must be 'reverse' or 'single', got {initial_bucketing!r}")
    # A hook reduces the buckets itself: "auto" then keeps them in private memory.
    return EngineOptions(comm="backend" if comm_hook is not None else comm,
                         comm_hook=comm_hook, comm_state=comm_state, limits=tuple(limits),
                         initial_bucketing=initial_bucketing, shard=shard, exact=exact,
                         slices=slices)
