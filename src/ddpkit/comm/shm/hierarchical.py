"""The shm engine across hosts: shared memory inside each host, the backend between
one leader per host.

A :class:`~ddpkit.comm.shm.allreduce.ShmCommunicator` whose group spans hosts keeps one
segment per host (its ranks' collectives inside the host run there, as on one host) and,
on each host's leader (its first rank in group order), a gloo subgroup of the leaders.
The functions here are the cross-host steps of its collectives; they take the
communicator and use its host-local pieces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm import ops


def leaders_group(view, hosts: dict[str, list[int]], is_leader: bool):
    """The leaders' subgroup (on a leader; None elsewhere). ``hosts`` maps each host to
    its group ranks in group order; the first of each is the host's leader."""
    leader_ranks = [view.global_rank(ranks[0]) for ranks in hosts.values()]
    if is_leader:
        backend = "gloo" if dist.is_gloo_available() else None
        return dist.new_group(
            leader_ranks, backend=backend, use_local_synchronization=True
        )
    return None


def all_reduce_across(comm, flat: torch.Tensor, where, local_op: str, divisor) -> None:
    """After the host-local reduction: leaders all-reduce their host's partial result,
    then every local rank takes its leader's."""
    if comm.leaders is not None and flat.numel():
        dist.all_reduce(flat, ops.TO_REDUCE_OP[local_op], group=comm.leaders)
    broadcast_from_leader(comm, flat, where)
    if divisor is not None and divisor != 1:
        flat.div_(divisor)


def broadcast_from_leader(comm, flat: torch.Tensor, where) -> None:
    """After the leaders' exchange, every local rank takes the leader's result."""
    if where is not None:
        start = where[1]
        stop = start + flat.numel() * flat.element_size()
        source = comm._regions(where[0])[0][start:stop].view(flat.dtype)
        comm.control.barrier()
        if not comm.is_leader:
            flat.copy_(source)
        comm.control.barrier()
        return
    numel, itemsize = flat.numel(), flat.element_size()
    step = comm.slot_bytes // itemsize
    comm.control.barrier()  # peers may still be copying results out of the leader's slot
    for start in range(0, numel, step):
        count = min(numel - start, step)
        source = comm._slots[0][: count * itemsize].view(flat.dtype)
        if comm.is_leader:
            source.copy_(flat[start:start + count])
        comm.control.barrier()
        if not comm.is_leader:
            flat[start:start + count].copy_(source)
        comm.control.barrier()


def barrier_across(comm) -> None:
    """After the host-local barrier: leaders meet, then each host waits for its leader."""
    if comm.leaders is not None:
        dist.barrier(group=comm.leaders)
    comm.control.barrier()
