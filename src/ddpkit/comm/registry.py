"""Named collective algorithms, so callers switch with ``algo=...`` and modules add their own.

An algorithm is any object with ``all_reduce(tensor, op, group)``; it may also provide
``reduce_scatter(output, input, op, group)``, ``all_gather(output, input, group)``,
``broadcast(tensor, src, group)``, ``reduce(tensor, dst, op, group)`` and
``barrier(group)``. Callers give it 1-D contiguous tensors, ``src``/``dst`` are global
ranks, and the group has at least two ranks. An algorithm without an in-band check
(below) never gets op "avg" (the caller sums and divides) nor an empty tensor.

An algorithm that checks calls in-band provides ``in_band(group) -> bool`` and
``refuse(signature, group)``. Where ``in_band`` is True the public layer skips its
agreement all-gather and passes ``signature=`` to every method (also for empty
tensors: a rank with nothing to send must still meet its peers' check). The signature
has the call's fields (``collective``, ``algo``, ``op``, ``dtype``, ``numel_in``,
``numel_out``, ``root``, ``problem``), ``row()`` (the call as eight integers to
exchange with the peers) and
``verdict(rows)`` (given every rank's row in group-rank order, raises the same
:class:`~ddpkit.errors.CommError` on every rank unless all agree; call it before
writing any result). The shm engine instead packs the fields into one word of its own
and judges those (``ShmAlgorithm``, ``ddpkit.comm.shm``). Such algorithms get op "avg"
and divide themselves. On a local refusal the public layer calls ``refuse`` instead of
the method, so that the peers raise at the call's own synchronisation.

``algo="auto"`` is not a registered algorithm: :func:`ddpkit.comm.auto.algo_for` picks
"shm", "hierarchical" or "backend" once per group and device type.
"""

from __future__ import annotations

import torch

from ddpkit.comm import auto
from ddpkit.comm.backend import BackendAlgorithm
from ddpkit.comm.ring import RingAlgorithm
from ddpkit.comm.shm.algorithm import ShmAlgorithm
from ddpkit.errors import CommError

_algorithms: dict[str, object] = {}
_version = [0]  # bumped on every change, so routes remembered for an old table are dropped


def version() -> int:
    return _version[0]


def register_algorithm(name: str, impl: object, *, replace: bool = False) -> None:
    """Make ``impl`` available as ``algo=name`` in every ddpkit.comm collective."""
    if not isinstance(name, str) or not name or name == "auto":
        raise CommError(f"algorithm name must be a non-empty string, not 'auto'; got {name!r}")
    if not callable(getattr(impl, "all_reduce", None)):
        raise CommError(f"algorithm {name!r} must provide all_reduce(tensor, op, group)")
    if name in _algorithms and not replace and _algorithms[name] is not impl:
        raise CommError(f"algorithm {name!r} is already registered; pass replace=True to swap it")
    _algorithms[name] = impl
    _version[0] += 1


def unregister_algorithm(name: str) -> None:
    _algorithms.pop(name, None)
    _version[0] += 1


def algorithms() -> tuple[str, ...]:
    """Names accepted by ``algo=`` besides "auto", in registration order."""
    return tuple(_algorithms)


def get_algorithm(name: str) -> object:
    try:
        return _algorithms[name]
    except (KeyError, TypeError):
        known = ", ".join(("auto", *_algorithms))
        raise CommError(f"unknown algorithm {name!r}; registered: {known}") from None


def resolve_algo(algo: str, tensor: torch.Tensor, group) -> tuple[str, object]:
    """(name, impl) for ``algo``; "auto" is decided once per group and device type."""
    if algo == "auto":
        algo = auto.algo_for(group, tensor.device)
    return algo, get_algorithm(algo)


def method(impl: object, name: str, collective: str):
    fn = getattr(impl, collective, None)
    if not callable(fn):
        raise CommError(
            f"algorithm {name!r} does not implement {collective}; use algo='ring' or 'backend'"
        )
    return fn


register_algorithm("backend", BackendAlgorithm())
register_algorithm("ring", RingAlgorithm())
# The tutorial's ring: one message per chunk, nothing overlapped. Kept to show what
# segmenting buys (see `ddpkit bench collectives --algo naive_ring,ring,backend`).
register_algorithm("naive_ring", RingAlgorithm(None, min_segments=1, in_flight=1))
# Same-host shared memory, and the same engine across hosts (shm inside each host, the
# backend between host leaders). Where shared memory cannot be set up every rank falls
# back to the backend together, so registering them everywhere is safe.
_shm = ShmAlgorithm()
register_algorithm("shm", _shm)
register_algorithm("hierarchical", _shm)
