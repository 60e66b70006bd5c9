"""async_op=True: handles, futures, ordering, and isolation from the caller's own calls."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit import comm
from ddpkit.errors import CommError


def _data(n: int, rank: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + salt)
    return torch.randint(-50, 50, (n,), generator=g).float()


def _summed(x: torch.Tensor, group=None) -> torch.Tensor:
    want = x.clone()
    dist.all_reduce(want, group=group)
    return want


def async_many_in_flight(world, algo: str) -> list[str]:
    bad = []
    xs = [_data(n, world.rank, i) for i, n in enumerate((1, 1000, 70_001, 3))]
    wants = [_summed(x) for x in xs]
    handles = [comm.all_reduce(x, algo=algo, async_op=True) for x in xs]
    # Sync calls on the default group while async ones are queued must not interfere.
    y = _data(500, world.rank, 99)
    want_y = _summed(y)
    comm.all_reduce(y, algo="ring")
    if not torch.equal(y, want_y):
        bad.append("sync ring between async calls")
    for i in reversed(range(len(xs))):  # waiting out of order is fine
        got = handles[i].wait()
        if got is not xs[i] or not torch.equal(xs[i], wants[i]):
            bad.append(f"async {algo} #{i}")
        if not handles[i].is_completed():
            bad.append(f"handle #{i} not completed after wait")
    return bad


def async_future_and_avg(world, algo: str) -> list[str]:
    x = _data(257, world.rank, 1)
    want = _summed(x) / world.world_size
    fut = comm.all_reduce(x, op="avg", algo=algo, async_op=True).get_future()
    chained = fut.then(lambda f: f.value().sum())
    value = fut.wait()
    bad = []
    if value is not x or not torch.equal(x, want):
        bad.append(f"{algo}: future value")
    if chained.wait().item() != want.sum().item():
        bad.append(f"{algo}: chained future")
    return bad


def async_other_collectives(world) -> list[str]:
    p, bad = world.world_size, []
    x = _data(6 * p, world.rank, 2)
    out = torch.empty(6)
    h1 = comm.reduce_scatter(out, x, async_op=True)
    ag_out = torch.empty(6 * p)
    h2 = comm.all_gather(ag_out, x[:6], async_op=True)
    b = _data(40, world.rank, 3)
    h3 = comm.broadcast(b, p - 1, async_op=True)
    for h in (h1, h2, h3):
        h.wait()
    want = torch.empty(6)
    dist.reduce_scatter_tensor(want, x.clone())
    if not torch.equal(out, want):
        bad.append("reduce_scatter")
    want = torch.empty(6 * p)
    dist.all_gather_into_tensor(want, x[:6].clone())
    if not torch.equal(ag_out, want):
        bad.append("all_gather")
    want = _data(40, p - 1, 3)
    if not torch.equal(b, want):
        bad.append("broadcast")
    return bad


def async_mismatch(world) -> str:
    x = torch.ones(100 + world.rank)
    try:
        comm.all_reduce(x, async_op=True).wait()
    except CommError as err:
        return f"CommError: {err}"
    except RuntimeError as err:  # torch wraps a future's exception
        return f"RuntimeError: {err}"
    return "ok"


def async_subgroups(world) -> list[str]:
    members = list(range(1, world.world_size))
    plain = dist.new_group(members)
    ours = comm.new_group(members)
    if world.rank not in members:
        return []
    bad = []
    try:
        comm.all_reduce(torch.ones(4), group=plain, async_op=True)
        bad.append("plain torch subgroup accepted an async ring call")
    except CommError as err:
        if "ddpkit.comm.new_group" not in str(err):
            bad.append(f"unhelpful message: {err}")
    x = _data(3001, world.rank, 5)
    want = _summed(x, group=ours)
    comm.all_reduce(x, group=ours, async_op=True).wait()
    if not torch.equal(x, want):
        bad.append("async ring on ddpkit.comm.new_group subgroup")
    y = _data(11, world.rank, 6)
    want = _summed(y, group=plain)
    comm.all_reduce(y, group=plain, algo="backend", async_op=True).wait()
    if not torch.equal(y, want):
        bad.append("async backend on a plain subgroup")
    return bad


def test_async_ring_many_in_flight_with_sync_calls_between(pools):
    assert pools(2).run(async_many_in_flight, "ring") == [[], []]
    assert pools(3).run(async_many_in_flight, "ring") == [[], [], []]


def test_async_backend_handles(pools):
    assert pools(2).run(async_many_in_flight, "backend") == [[], []]


def test_async_future_value_is_the_result(pools):
    for algo in ("ring", "backend"):
        assert pools(3).run(async_future_and_avg, algo) == [[], [], []]


def test_async_reduce_scatter_all_gather_broadcast(pools):
    assert pools(3).run(async_other_collectives) == [[], [], []]


def test_async_mismatch_fails_every_wait(pools):
    for outcome in pools(2).run(async_mismatch):
        assert "differ across ranks" in outcome, outcome


def test_async_subgroups_need_ddpkit_new_group(pools):
    assert pools(3).run(async_subgroups) == [[], [], []]


def lanes_reopen(world) -> bool:
    x = _data(99, world.rank, 7)
    want = _summed(x)
    comm.all_reduce(x, async_op=True).wait()
    comm.close_lanes()  # every rank, nothing outstanding
    y = _data(99, world.rank, 8)
    want_y = _summed(y)
    comm.all_reduce(y, async_op=True).wait()  # a fresh lane and companion group
    return torch.equal(x, want) and torch.equal(y, want_y)


def test_close_lanes_then_async_again(pools):
    assert pools(2).run(lanes_reopen) == [True, True]
