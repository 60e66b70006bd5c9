"""DataParallel on one host: a single-host CPU training step makes no backend call.

Under the default ``comm`` ("auto" -> shm on one host) every collective of a steady-state
step rides the shared segment: the bucket sums, the buffer broadcast before each forward
(BatchNorm running statistics), the ``find_unused_parameters`` flag all-reduce and, inside
``ddpkit.join``, the per-forward "who still trains" exchange. The counter patches every
public torch.distributed collective *and* the process group's own methods (what those
functions call), so a call through either is seen; the control with ``comm="backend"``
shows the same counter does see the calls that path makes.

Replicas stay bitwise identical on the shm path, and, with uneven inputs under join, the
shm path ends on the same parameters as ``comm="backend"`` (the shadowing ranks' traffic
goes through the same transport).
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import ProcessGroup

DIST_FUNCTIONS = (
    "all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "reduce",
    "isend", "irecv", "send", "recv", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast_object_list", "gather", "scatter", "all_to_all",
    "all_to_all_single", "monitored_barrier", "all_reduce_coalesced",
)
GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "barrier", "send", "recv",
    "recv_anysource", "gather", "scatter", "alltoall", "alltoall_base", "monitored_barrier",
)


class Net(nn.Module):
    """BatchNorm buffers to broadcast, and a branch only some steps use (so the
    find_unused flags matter)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 96), nn.BatchNorm1d(96), nn.ReLU(),
                                  nn.Linear(96, 64), nn.BatchNorm1d(64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.extra = nn.Linear(64, 4)  # used on odd steps only

    def forward(self, x, use_extra=False):
        h = self.body(x)
        out = self.head(h)
        return out + self.extra(h) if use_extra else out


def _batch(step, rank, n=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


class Counter:
    """Counts torch.distributed calls, at the functions and at the process group."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self._patches = []

    def _wrap(self, label, real):
        def counted(*args, **kwargs):
            self.calls[label] = self.calls.get(label, 0) + 1
            return real(*args, **kwargs)

        return counted

    def __enter__(self):
        for name in DIST_FUNCTIONS:
            real = getattr(dist, name, None)
            if real is not None:
                self._patches.append(mock.patch.object(dist, name, self._wrap(name, real)))
        for name in GROUP_METHODS:
            real = getattr(ProcessGroup, name, None)
            if real is not None:
                self._patches.append(
                    mock.patch.object(ProcessGroup, name, self._wrap(f"pg.{name}", real)))
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self._patches):
            patch.stop()


def _train(ddp, opt, steps, first, rank):
    for step in range(first, first + steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(ddp(x, use_extra=step % 2 == 1), y).backward()
        opt.step()


def steady_state_calls(world, comm):
    from ddpkit import join
    from ddpkit.parallel import DataParallel

    r = world.rank
    torch.manual_seed(3)
    model = Net()
    ddp = DataParallel(model, find_unused_parameters=True, **({} if comm is None else
                                                                {"comm": comm}))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    _train(ddp, opt, 2, 0, r)  # warm-up: layout exchange and segments happen before this
    # join's set-up is not a step: entered before counting (its exit is not counted)
    with join(ddp), Counter() as plain:
        _train(ddp, opt, 2, 2, r)
    with Counter() as outside:
        _train(ddp, opt, 3, 4, r)
        # an eval forward takes rank 0's running statistics and leaves them as they are
        ddp.eval()
        with torch.no_grad():
            ddp(_batch(9, r)[0])
    calls = dict(plain.calls)
    for name, n in outside.calls.items():
        calls[name] = calls.get(name, 0) + n
    state = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    gathered: list = [None] * world.world_size
    dist.all_gather_object(gathered, state)
    identical = all(torch.equal(a, b) for other in gathered for a, b in zip(other, gathered[0]))
    return {"transport": ddp.comm, "calls": calls, "identical": identical}


@pytest.mark.parametrize("world_size", [2, 3])
def test_default_comm_step_makes_no_backend_call(pools, world_size):
    for rank, result in enumerate(pools(world_size).run(steady_state_calls, None)):
        assert result["transport"] == "shm", result
        assert result["calls"] == {}, f"rank {rank} called torch.distributed: {result['calls']}"
        assert result["identical"], f"rank {rank}: replicas differ"


def test_counter_sees_the_backend_path(pools):
    # The control that proves the counting works: comm="backend" makes its bucket
    # all-reduces, buffer broadcasts, flag and join all-reduces through torch.
    for result in pools(2).run(steady_state_calls, "backend"):
        assert result["transport"] == "backend"
        calls = result["calls"]
        assert calls.get("all_reduce", 0) >= 5 * 2 + 2, calls  # buckets+flags, join
        assert calls.get("broadcast", 0) >= 6, calls  # buffers before every forward
        assert calls.get("pg.allreduce", 0) >= calls["all_reduce"], calls
        assert result["identical"]


def uneven_join(world, comm, batches):
    from ddpkit import join
    from ddpkit.parallel import DataParallel

    r = world.rank
    torch.manual_seed(5)
    ddp = DataParallel(Net(), find_unused_parameters=True, comm=comm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with join(ddp):
        _train(ddp, opt, batches[r], 0, r)
    return [t.detach().clone() for t in list(ddp.module.parameters()) + list(ddp.module.buffers())]


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_inputs_under_join_shm_equals_backend(pools, world_size):
    batches = [4, 2, 3][:world_size]
    pool = pools(world_size)
    shm = pool.run(uneven_join, "auto", batches)
    backend = pool.run(uneven_join, "backend", batches)
    for rank in range(world_size):
        assert all(torch.equal(a, b) for a, b in zip(shm[rank], shm[0])), rank
        # W=2: two addends, any order is exact; W=3 sums may differ in the last bit
        assert len(shm[rank]) == len(backend[rank]) > 0, rank
        for a, b in zip(shm[rank], backend[rank]):
            if world_size == 2:
                assert torch.equal(a, b), rank
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
