"""What DataParallel asks of a reducer and of a transport, whatever the mode.

Every mode is one reducer and one transport: the default engine's bucketed
:class:`~ddpkit.parallel.engine.reducer.BucketReducer` on a backend, ring or
shared-memory transport (:mod:`ddpkit.parallel.engine.transport`), ZeRO-2 and 3's
:class:`~ddpkit.parallel.zero.scatter_reducer.ScatterReducer` on the same transports
(which then also offer :class:`ShardingTransport`), and exact mode's
:class:`~ddpkit.parallel.exact.exact_reducer.ExactReducer` on its
:class:`~ddpkit.parallel.exact.exact_transport.ExactTransport`. DataParallel, the join
machinery and the reducers talk to each other only through the members named here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ddpkit.parallel.grad_bucket import GradBucket

CommHook = Callable[[object, GradBucket], torch.futures.Future]


class Work(Protocol):
    """A collective in flight (torch's ``Work``, ddpkit's ``CommHandle``)."""

    def wait(self) -> object: ...


class Transport(Protocol):
    """How one rank's tensors meet the group's: the reducer's bucket sums and the engine's
    other per-step traffic (buffers, join's exchange, the re-bucketing order), so that a
    transport that avoids the backend avoids it for the whole step."""

    @property
    def name(self) -> str:
        """What ``model.comm`` reports: ``"shm"``, ``"backend"`` or ``"ring"``."""
        ...

    @property
    def reduces_inline(self) -> bool:
        """Whether :meth:`all_reduce` of a CPU buffer runs on the calling thread and is
        complete when it returns (launching such sums early overlaps nothing)."""
        ...

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Storage for a buffer the transport will sum (a gradient bucket): where its
        sum reads it in place, e.g. the host's shared segment. Contents unspecified."""
        ...

    def all_reduce(self, buffer: torch.Tensor) -> Work | None:
        """Sum ``buffer`` across the group in place: a handle to wait on, or None when
        the sum is complete on return."""
        ...

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int, *,
                  every_step: bool = False) -> None:
        """Overwrite ``tensors`` with group rank ``src``'s values (``every_step``: the
        same list comes again each step, so its packing may be planned once)."""
        ...

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor across the group in place, complete on return."""
        ...

    def close(self) -> None:
        """Let go of what the transport holds (a shared-memory mapping)."""
        ...


class ShardingTransport(Transport, Protocol):
    """A transport a sharded (ZeRO) engine can run on."""

    def reduce_own_chunk(self, buffer: torch.Tensor) -> Work | None:
        """Leave at least this rank's chunk of ``buffer`` (:func:`ddpkit.comm.chunk_bounds`)
        summed across the group, with the bits :meth:`all_reduce` gives it."""
        ...

    def all_gather_chunks(self, flat: torch.Tensor, bounds: Sequence[int]) -> None:
        """Every rank gets group rank r's ``flat[bounds[r]:bounds[r + 1]]``, in place."""
        ...


class Reducer(Protocol):
    """What reduces the gradients of one backward, armed by DataParallel's forward."""

    params: list[torch.nn.Parameter]  # the trainable parameters it reduces, in order
    names: list[str]  # theirs, as the module names them
    armed: bool  # the backward under way synchronizes (set by arm, cleared at its end)

    def arm(self, divisor: int) -> None:
        """The next backward synchronizes; the summed gradients get divided by
        ``divisor`` (the world size, or under join the ranks that count)."""
        ...

    def disarm(self) -> None:
        """The next backward only accumulates (``no_sync()``, a no-grad forward)."""
        ...

    def maybe_rebuild(self, src: int) -> None:
        """At a synchronized forward: lay the buckets out again by the gradient order
        group rank ``src`` observed, if that is due (collective)."""
        ...

    def shadow_backward(self, divisor: int) -> None:
        """Under join, on a rank with no more data: issue this rank's share of one
        backward's collectives, with zero gradients."""
        ...

    def set_comm_hook(self, hook: CommHook, state: object) -> None:
        """Reduce through ``hook(state, bucket)`` from now on (torch's
        ``register_comm_hook``: once)."""
        ...

    def set_static_graph(self) -> None:
        """torch's static graph: the same parameters go unused in every backward."""
        ...

    def bucket_names(self) -> list[list[str]]:
        """Parameter names per reduction unit (bucket), in the order they are reduced."""
        ...

    def bucket_sizes(self) -> list[int]:
        """Elements per reduction unit, in the same order."""
        ...
