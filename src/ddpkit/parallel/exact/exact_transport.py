"""Exact mode's transport: where a step's collectives run.

Exact mode sums a step's gradients with a MAX all-reduce of the per-element scale, then
a SUM all-reduce of fixed-point integers (the int32 and float64 formats), or with one
all-gather of every slice's float32 row (the gather format, :meth:`gather_`). All are
exact and order-free (an all-gather only moves bits), so any algorithm gives the same
bits; ``comm=`` only chooses where they run, as it does for the default engine
(``model.comm`` says which):

* ``"shm"`` (what ``"auto"`` means for CPU ranks that share a host): the default
  engine's shared-memory transport, with the two reduced buffers allocated in its
  segment so nothing is copied in or out; the int32 sum there reads every rank's
  buffers in place (:meth:`ExactTransport.peer_views`, ordered by
  :meth:`ExactTransport.barrier`) instead of all-reducing them; where the segment
  cannot be set up, ``"auto"`` falls back to the backend on every rank with one
  warning, as the default engine does;
* ``"backend"``, ``"ring"``: :func:`ddpkit.comm.all_reduce` (and ``all_gather``) with
  that algorithm.

Everything else the engine sends (the seed agreed at construction, and what any
:class:`~ddpkit.parallel.engine.interfaces.Transport` carries) goes the same way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddpkit.comm import all_gather as comm_all_gather
from ddpkit.comm import all_reduce as comm_all_reduce
from ddpkit.parallel.engine import transport
from ddpkit.parallel.engine.state_sync import broadcast_coalesced
from ddpkit.parallel.exact.exact_sum32 import FORMAT_ENV, FORMATS, choose_format


class ExactTransport:
    """Implements :class:`ddpkit.parallel.engine.interfaces.Transport` for exact mode,
    plus :meth:`max_`. Every call is blocking (the sum runs after the last slice's
    backward, not overlapped with it). Created collectively, with the engine."""

    reduces_inline = True

    def __init__(self, comm: str, device: torch.device, group):
        self.group = group
        self.name = transport.resolve_comm(comm, [device.type], group)
        self._shm: transport.ShmTransport | None = None
        if self.name == "shm" and dist.get_world_size(group) > 1:
            built = transport.build(comm, [device.type], group)
            if isinstance(built, transport.ShmTransport):
                self._shm = built
            else:  # shared memory could not be set up: the backend, on every rank
                self.name = built.name

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._shm is not None:
            return self._shm.allocate(numel, dtype, device)
        return torch.empty(numel, dtype=dtype, device=device)

    def all_reduce(self, buffer: torch.Tensor) -> None:
        self.sum_(buffer)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, "sum")

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum across the group, in place, complete on return."""
        return self._reduce(tensor, "max")

    def gather_(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """Every rank's ``input`` into ``output``, in rank order, complete on return
        (the "gather" format's one collective)."""
        if self._shm is not None and input.device.type == "cpu":
            self._shm.comm.all_gather(output, input)
        else:
            comm_all_gather(output, input, group=self.group, algo=self.name)
        return output

    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self._shm is not None:
            self._shm.reduce_(tensor, op)
        else:
            comm_all_reduce(tensor, op=op, algo=self.name, group=self.group)
        return tensor

    def peer_views(self, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]] | None:
        """Per tensor of ``tensors`` (each from :meth:`allocate`), every rank's
        counterpart in rank order, readable in place: on one host's shared segment
        (whose local ranks are the group's, in order), where a sum may
        read its peers' rows itself instead of all-reducing them. None (on every rank
        alike: agreed with one small collective, so call it on every rank together)
        where some rank's tensors are not all in the segment. Order accesses with
        :meth:`barrier`."""
        if self._shm is None:  # (the same on every rank: the transport was agreed)
            return None
        views = [self._shm.comm.peer_views(t) for t in tensors]
        found = all(v is not None for v in views)
        everywhere = torch.tensor([int(found)], dtype=torch.int32)
        self._shm.comm.all_reduce(everywhere, "min")
        return views if int(everywhere) else None

    def barrier(self) -> None:
        """Every rank has arrived (and its writes to the shared segment are visible)."""
        if self._shm is not None:
            self._shm.comm.barrier()
        else:
            dist.barrier(group=self.group)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int, *,
                  every_step: bool = False) -> None:
        if self._shm is not None:
            self._shm.broadcast(tensors, src, every_step=every_step)
        else:
            broadcast_coalesced(tensors, src, self.group)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()


def agreed_settings(transport: ExactTransport, world_size: int, device: torch.device,
                     seed: int | None) -> tuple[int, str | None]:
    """Rank 0's seed (``seed``, else ``torch.initial_seed()``: the seed the program gave
    torch) and requested sum format (``$DDPKIT_EXACT_SUM``, None: the default), on
    every rank: a rank with another setting would send buffers of another dtype."""
    requested = os.environ.get(FORMAT_ENV, "").strip() or None
    choose_format(1, requested, numel=0)  # a misspelt name: one line, before any collective
    chosen = torch.initial_seed() if seed is None else int(seed)
    agreed = torch.tensor([chosen & ((1 << 63) - 1),
                           0 if requested is None else 1 + FORMATS.index(requested)],
                          dtype=torch.int64, device=device)
    if world_size > 1:
        transport.broadcast([agreed], 0)
    code = int(agreed[1])
    return int(agreed[0]), None if code == 0 else FORMATS[code - 1]
