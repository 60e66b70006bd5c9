"""ddpkit.comm on torch.distributed's calling convention, and complex tensors.

Lines moved over from ``torch.distributed`` keep their meaning: the same positional
order (``all_reduce(tensor, op, group, async_op)``, ``broadcast(tensor, src, group)``,
...), ``algo=`` keyword-only; complex tensors are summed and averaged by all_reduce and
moved by broadcast/all_gather as torch does, and the ops torch refuses on them raise
torch's ValueError. Every result is compared with torch's own on the same input.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpkit import comm

ALGOS = ("auto", "ring", "backend")


def _like_torch(ours, theirs, make):
    """Run ``ours`` and ``theirs`` on equal inputs from ``make()``; equal results?"""
    a, b = make(), make()
    ours(a)
    theirs(b)
    return torch.equal(a, b)


def run_positional(world):
    r, p = world.rank, world.world_size
    sub = dist.new_group(list(range(p)))
    x = lambda: torch.arange(12, dtype=torch.float32) * (r + 1) + 0.5  # noqa: E731
    sum_, mx = dist.ReduceOp.SUM, dist.ReduceOp.MAX
    checks = {
        "all_reduce(t, op, group)": _like_torch(
            lambda t: comm.all_reduce(t, mx, sub), lambda t: dist.all_reduce(t, mx, sub), x),
        "all_reduce(t, op, group, True).wait()": _like_torch(
            lambda t: comm.all_reduce(t, sum_, None, True).wait(),
            lambda t: dist.all_reduce(t, sum_, None, True).wait(), x),
        "broadcast(t, src, group)": _like_torch(
            lambda t: comm.broadcast(t, p - 1, sub), lambda t: dist.broadcast(t, p - 1, sub), x),
        "broadcast(t, group_src=...)": _like_torch(
            lambda t: comm.broadcast(t, group=sub, group_src=1),
            lambda t: dist.broadcast(t, group=sub, group_src=1), x),
        "barrier(group)": comm.barrier(sub) is None,
    }
    reduced, expected = x(), x()
    comm.reduce(reduced, 0, sum_, sub)
    dist.reduce(expected, 0, sum_, sub)
    checks["reduce(t, dst, op, group)"] = r != 0 or torch.equal(reduced, expected)
    out, want = torch.empty(12 * p), torch.empty(12 * p)
    comm.all_gather(out, x(), sub)
    dist.all_gather_into_tensor(want, x(), sub)
    checks["all_gather(out, in, group)"] = torch.equal(out, want)
    out, want = torch.empty(12 // p * 1), torch.empty(12 // p * 1)
    big = lambda: torch.arange(12 // p * p, dtype=torch.float32) + r  # noqa: E731
    comm.reduce_scatter(out, big(), sum_, sub)
    dist.reduce_scatter_tensor(want, big(), sum_, sub)
    checks["reduce_scatter(out, in, op, group)"] = torch.equal(out, want)
    return checks


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_positional_order_means_the_same(pools, world_size):
    for rank, checks in enumerate(pools(world_size).run(run_positional)):
        wrong = [call for call, ok in checks.items() if not ok]
        assert not wrong, f"rank {rank}: differs from torch.distributed: {wrong}"


def run_complex(world, algo):
    r = world.rank
    results = {}
    for dtype in (torch.complex64, torch.complex128):
        def make(dtype=dtype):
            return torch.complex(torch.arange(10, dtype=torch.float64) * (r + 1),
                                 torch.arange(10, dtype=torch.float64) - r).to(dtype)

        results[f"sum {dtype}"] = _like_torch(
            lambda t: comm.all_reduce(t, "sum", algo=algo),
            lambda t: dist.all_reduce(t), make)
        avg = make()
        comm.all_reduce(avg, "avg", algo=algo)
        want = make()
        dist.all_reduce(want)
        results[f"avg {dtype}"] = torch.allclose(avg, want / world.world_size)
        # non-contiguous: every other element of a longer tensor
        results[f"strided sum {dtype}"] = _like_torch(
            lambda t: comm.all_reduce(t[::2], algo=algo),
            _strided_torch, make)
        results[f"broadcast {dtype}"] = _like_torch(
            lambda t: comm.broadcast(t, 0, algo=algo), lambda t: dist.broadcast(t, 0), make)
        out = torch.empty(10 * world.world_size, dtype=dtype)
        want = torch.empty_like(out)
        comm.all_gather(out, make(), algo=algo)
        dist.all_gather_into_tensor(want, make())
        results[f"all_gather {dtype}"] = torch.equal(out, want)
    refusals = {}
    for op in ("max", "min", "product"):
        try:
            comm.all_reduce(torch.ones(4, dtype=torch.complex64), op, algo=algo)
            refusals[op] = None
        except ValueError as exc:  # torch's type for it
            refusals[op] = str(exc)
    return results, refusals


def _strided_torch(t):
    part = t[::2].contiguous()
    dist.all_reduce(part)
    t[::2] = part


@pytest.mark.parametrize("algo", ALGOS)
def test_complex_tensors_reduced_where_torch_reduces_them(pools, algo):
    for rank, (results, refusals) in enumerate(pools(2).run(run_complex, algo)):
        wrong = [what for what, ok in results.items() if not ok]
        assert not wrong, f"rank {rank}, algo={algo}: differs from torch: {wrong}"
        for op, message in refusals.items():
            assert message and "all_reduce does not support" in message, (op, message)


def test_complex_at_three_ranks(pools):
    for rank, (results, refusals) in enumerate(pools(3).run(run_complex, "auto")):
        assert all(results.values()), f"rank {rank}: {results}"
        assert all(refusals.values()), refusals
