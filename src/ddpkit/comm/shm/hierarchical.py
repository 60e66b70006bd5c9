"""The shm engine across hosts: shared memory inside each host, the backend between
one leader per host.

A :class:`~ddpkit.comm.shm.communicator.ShmCommunicator` whose group spans hosts keeps one
segment per host (its ranks' collectives inside the host run there, as on one host) and,
on each host's leader (its first rank in group order), a gloo subgroup of the leaders.
The functions here are the cross-host shapes of its collectives; they take the
communicator and use its host-local steps. Every collective crosses the hosts once,
between the leaders, with one backend call of the collective's own kind:

* all_reduce: shm all-reduce inside each host, leaders all-reduce, each leader's
  result copied to its host;
* broadcast(src): src's host shm-broadcasts from src (so its leader has the tensor),
  leaders broadcast from that leader, every other host shm-broadcasts from its leader;
* reduce(dst): shm all-reduce inside each host on copies, leaders reduce onto dst's
  host's leader, which hands the result to dst when dst is not itself;
* all_gather: shm all-gather into the host's block of the output, leaders all-gather
  the host blocks, every leader hands its host the blocks of the other hosts;
* reduce_scatter: shm all-reduce of a copy of the input inside each host, leaders
  reduce-scatter it by host blocks, every leader hands each of its ranks its block.

all_gather and reduce_scatter place blocks by group rank, so they are hierarchical only
when every host's ranks are consecutive group ranks, the same number on every host
(torchrun's layout): :func:`host_blocks`, decided from the host exchange every rank
made, so alike everywhere. Other layouts take the backend (the registry face decides).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm.backend import BackendAlgorithm
from ddpkit.errors import CommError

# the leaders' backend calls (a name of its own: tests watch it)
_leaders = BackendAlgorithm()


def leaders_group(view, hosts: dict[str, list[int]], is_leader: bool):
    """The leaders' subgroup (on a leader; None elsewhere). ``hosts`` maps each host to
    its group ranks in group order; the first of each is the host's leader."""
    leader_ranks = [view.global_rank(ranks[0]) for ranks in hosts.values()]
    backend = "gloo" if dist.is_gloo_available() else None
    if view.size == dist.get_world_size():
        # Every process of the job builds this communicator, so all of them can take part
        # in creating the group: torch then names it by a counter that is the same on
        # every rank. A group made by its members alone is named from how many groups
        # each member holds, which differs wherever a rank made or dropped a group its
        # peers did not, and then the members wait for each other forever.
        group = dist.new_group(leader_ranks, backend=backend)
        return group if is_leader else None
    if is_leader:  # a subgroup's communicator: only its members are here
        return dist.new_group(leader_ranks, backend=backend, use_local_synchronization=True)
    return None


def all_reduce_across(comm, flat: torch.Tensor, where, local_op: str, divisor) -> None:
    """After the host-local reduction: leaders all-reduce their host's partial result,
    then every local rank takes its leader's."""
    if comm.leaders is not None and flat.numel():
        _leaders.all_reduce(flat, local_op, comm.leaders)
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
        _leaders.barrier(comm.leaders)
    comm.control.barrier()


def host_blocks(hosts: list[list[int]], view) -> bool:
    """Whether every host's ranks are one block of consecutive group ranks, all blocks
    the same size, and the hosts' leaders in the same order by global rank (the order
    of the leaders' subgroup), so host h's block of a gathered tensor is its leader's
    block among the leaders. Always true on one host."""
    size = len(hosts[0])
    leaders = [view.global_rank(ranks[0]) for ranks in hosts]
    return (all(ranks == list(range(h * size, (h + 1) * size)) for h, ranks in enumerate(hosts))
            and leaders == sorted(leaders))


def _host_of(comm, global_rank: int, what: str) -> int:
    group_rank = comm.view.group_rank_of(global_rank, what)
    return next(h for h, ranks in enumerate(comm.hosts) if group_rank in ranks)


def _leader(comm, host: int) -> int:
    """Global rank of ``host``'s leader."""
    return comm.view.global_rank(comm.hosts[host][0])


def broadcast_across(comm, flat: torch.Tensor, src: int, code: int) -> None:
    """``flat`` from global rank ``src`` to every rank (in place)."""
    numel, dtype = flat.numel(), flat.dtype
    home = _host_of(comm, src, "src")
    if comm.host == home:  # first inside src's host: its leader needs the tensor
        comm._send_from(comm._local_of(src, "src"), flat, numel, dtype, code, comm._into(flat))
    if comm.leaders is not None and numel:
        _leaders.broadcast(flat, _leader(comm, home), comm.leaders)
    if comm.host != home:
        comm._send_from(0, flat, numel, dtype, code, comm._into(flat))


def reduce_across(comm, flat: torch.Tensor, dst: int, name: str, code: int) -> None:
    """Reduce ``flat`` onto global rank ``dst``; every other rank's ``flat`` is left as
    it was (they reduce copies)."""
    numel, dtype = flat.numel(), flat.dtype
    home = _host_of(comm, dst, "dst")
    is_dst = comm._is(dst)
    local_op = "sum" if name == "avg" else name
    work = flat if is_dst else flat.clone()
    comm.all_reduce(work, local_op, signature=code, across_hosts=False)
    if comm.leaders is not None and numel:
        _leaders.reduce(work, _leader(comm, home), local_op, comm.leaders)
    if comm.host == home and comm.local[0] != comm.view.group_rank_of(dst, "dst"):
        # dst is not its host's leader: the leader hands the result to dst alone
        comm._send_from(0, work, numel, dtype, code, comm._into(flat) if is_dst else None)
    if is_dst and name == "avg":
        flat.div_(comm.view.size)


def _check_blocks(comm, collective: str) -> None:
    if not comm.host_blocks:
        sizes = "+".join(str(len(ranks)) for ranks in comm.hosts)
        raise CommError(
            f"shm {collective} across hosts needs every host's ranks to be consecutive group "
            f"ranks, the same number per host (this group: {sizes} ranks on "
            f"{comm.nhosts} hosts); use algo='backend'")


def all_gather_across(comm, out: torch.Tensor, src: torch.Tensor, code: int) -> None:
    """Every rank's ``src`` into ``out`` in group-rank order (needs :func:`host_blocks`)."""
    _check_blocks(comm, "all_gather")
    size = comm.local_size * src.numel()  # one host's block of ``out``
    lo, hi = comm.host * size, (comm.host + 1) * size
    block = out[lo:hi]
    comm._gather_local(block, src, code)
    if comm.leaders is not None and out.numel():
        # a copy: the backend's input must not alias the output it writes
        _leaders.all_gather(out, block.clone(), comm.leaders)
    # the host's own block is already in place on every rank: hand over the others'
    for part in (out[:lo], out[hi:]):
        if part.numel():  # the same on every rank of a host, as the call must be
            comm._send_from(0, part, part.numel(), part.dtype, code, comm._into(part))


def reduce_scatter_across(comm, out: torch.Tensor, src: torch.Tensor, name: str, code: int) -> None:
    """Reduce ``src`` across the group; group rank i gets block i in ``out`` (needs
    :func:`host_blocks`). ``src`` is left as it was."""
    _check_blocks(comm, "reduce_scatter")
    m = out.numel()
    local_op = "sum" if name == "avg" else name
    work = src.clone()
    comm.all_reduce(work, local_op, signature=code, across_hosts=False)
    mine = None
    if comm.leaders is not None:
        mine = torch.empty(comm.local_size * m, dtype=out.dtype)  # this host's blocks
        if m:
            _leaders.reduce_scatter(mine, work, local_op, comm.leaders)
        out.copy_(mine[:m])
    # the leader keeps block 0; local rank i (i >= 1) takes block i
    lo, hi = (comm.me - 1) * m, comm.me * m

    def take(start: int, piece: torch.Tensor) -> None:
        a, b = max(lo, start), min(hi, start + piece.numel())
        if a < b:
            out[a - lo:b - lo].copy_(piece[a - start:b - start])

    rest = (comm.local_size - 1) * m
    comm._send_from(0, None if mine is None else mine[m:], rest, out.dtype, code, take)
    if name == "avg":
        out.div_(comm.view.size)

