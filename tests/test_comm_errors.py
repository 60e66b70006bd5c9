"""Refusals and mismatches: the same clear CommError on every rank, never a hang.

Without the agreement check, a size mismatch makes gloo abort the whole process
(``terminate called after throwing gloo::EnforceNotMet``); these tests would then fail
with a dead pool rather than pass. After each refusal the group must still work.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpkit import comm
from ddpkit.errors import CommError


def _outcome(fn) -> str:
    try:
        fn()
    except CommError as err:
        return f"CommError: {err}"
    return "ok"


def _still_works(world) -> bool:
    x = torch.arange(10, dtype=torch.float32) * (world.rank + 1)
    want = x.clone()
    dist.all_reduce(want)
    comm.all_reduce(x)
    return torch.equal(x, want)


def mismatched_call(world, case: str) -> tuple[str, bool]:
    r = world.rank
    last = world.world_size - 1
    if case == "size":
        fn = lambda: comm.all_reduce(torch.ones(1000 + (r == last) * 3))
    elif case == "dtype":
        fn = lambda: comm.all_reduce(torch.ones(8, dtype=torch.float64 if r == last else None))
    elif case == "op":
        fn = lambda: comm.all_reduce(torch.ones(8), op="max" if r == last else "sum")
    elif case == "algo":
        fn = lambda: comm.all_reduce(torch.ones(8), algo="backend" if r == last else "ring")
    elif case == "root":
        fn = lambda: comm.broadcast(torch.ones(8), src=r % 2)
    elif case == "collective":
        fn = (lambda: comm.broadcast(torch.ones(8), 0)) if r == last else (
            lambda: comm.all_reduce(torch.ones(8)))
    elif case == "unknown_algo_on_one_rank":
        fn = lambda: comm.all_reduce(torch.ones(8), algo="rign" if r == last else "ring")
    elif case == "all_gather_size":
        n = 4 + (r == last)
        fn = lambda: comm.all_gather(torch.zeros(n * world.world_size), torch.ones(n))
    else:
        raise AssertionError(case)
    return _outcome(fn), _still_works(world)


def refused_everywhere(world, case: str) -> tuple[str, bool]:
    p = world.world_size
    fn = {
        "avg_int": lambda: comm.all_reduce(torch.ones(8, dtype=torch.int64), op="avg"),
        "band_float": lambda: comm.all_reduce(torch.ones(8), op="band"),
        "bool": lambda: comm.all_reduce(torch.ones(8, dtype=torch.bool)),
        "complex": lambda: comm.all_reduce(torch.ones(8, dtype=torch.complex64)),
        "unknown_op": lambda: comm.all_reduce(torch.ones(8), op="mean"),
        "unknown_algo": lambda: comm.all_reduce(torch.ones(8), algo="nope"),
        "root_out_of_group": lambda: comm.broadcast(torch.ones(8), src=p + 5),
        "rs_bad_shape": lambda: comm.reduce_scatter(torch.zeros(3), torch.ones(3 * p + 1)),
        "ag_dtype": lambda: comm.all_gather(torch.zeros(2 * p), torch.ones(2, dtype=torch.int64)),
        "not_tensor": lambda: comm.all_reduce([1.0, 2.0]),
        "missing_collective": lambda: comm.broadcast(torch.ones(8), 0, algo="only_all_reduce"),
    }[case]
    comm.register_algorithm("only_all_reduce", OnlyAllReduce(), replace=True)
    return _outcome(fn), _still_works(world)


class OnlyAllReduce:
    """A minimal registered algorithm: all_reduce through torch, nothing else."""

    def all_reduce(self, tensor, op, group):
        dist.all_reduce(tensor, comm.ops.TO_REDUCE_OP[op], group=group)


MISMATCHES = {
    "size": "1000",
    "dtype": "float64",
    "op": "op=max",
    "algo": "algo=backend",
    "root": "root=",
    "collective": "differ",
    "unknown_algo_on_one_rank": "rign",
    "all_gather_size": "differ",
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_is_an_error_on_every_rank(pools, case):
    results = pools(2).run(mismatched_call, case)
    for rank, (outcome, still_works) in enumerate(results):
        assert outcome.startswith("CommError"), (rank, outcome)
        assert still_works, f"rank {rank}: the group did not work after the refusal"
    # every rank names the problem; the refusing rank (last) its own reason
    assert any(MISMATCHES[case] in outcome for outcome, _ in results), results


def test_size_mismatch_names_every_rank_size_at_three_ranks(pools):
    results = pools(3).run(mismatched_call, "size")
    for outcome, still_works in results:
        assert "rank 0: 1000 x float32" in outcome and "rank 2: 1003 x float32" in outcome
        assert still_works


REFUSALS = {
    "avg_int": "truncate",
    "band_float": "integer",
    "bool": "not supported",
    "complex": "not supported",
    "unknown_op": "unknown reduce op",
    "unknown_algo": "unknown algorithm 'nope'",
    "root_out_of_group": "not a member",
    "rs_bad_shape": "needs group size",
    "ag_dtype": "dtype",
    "not_tensor": "torch.Tensor",
    "missing_collective": "does not implement broadcast",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unsupported_call_is_refused_on_every_rank(pools, case):
    for outcome, still_works in pools(2).run(refused_everywhere, case):
        assert outcome.startswith("CommError") and REFUSALS[case] in outcome, outcome
        assert still_works


# -- registry (no processes needed) ---------------------------------------------------


def test_registry_lists_builtins_and_refuses_bad_registrations():
    assert {"ring", "naive_ring", "backend"} <= set(comm.algorithms())
    with pytest.raises(CommError, match="already registered"):
        comm.register_algorithm("ring", comm.RingAlgorithm(4096))
    with pytest.raises(CommError, match="all_reduce"):
        comm.register_algorithm("empty", object())
    with pytest.raises(CommError, match="auto"):
        comm.register_algorithm("auto", OnlyAllReduce())
    with pytest.raises(CommError, match="unknown algorithm"):
        comm.get_algorithm("nope")


class Picky:
    """Claims float32 tensors for algo='auto' and counts what it reduced."""

    def __init__(self):
        self.calls = 0

    def supports(self, tensor, group) -> bool:
        return tensor.dtype == torch.float32

    def all_reduce(self, tensor, op, group):
        self.calls += 1
        dist.all_reduce(tensor, comm.ops.TO_REDUCE_OP[op], group=group)


def auto_selection(world) -> tuple[int, bool]:
    picky = Picky()
    # Other claimants (e.g. "shm") would be asked first; set them aside for this test.
    others = {n: comm.get_algorithm(n) for n in comm.algorithms()
              if hasattr(comm.get_algorithm(n), "supports")}
    for name in others:
        comm.unregister_algorithm(name)
    comm.register_algorithm("picky", picky, replace=True)
    try:
        a = torch.ones(16)
        b = torch.ones(16, dtype=torch.float64)
        comm.all_reduce(a, algo="auto")  # picky claims it
        comm.all_reduce(b, algo="auto")  # nobody claims float64: backend
        ok = torch.equal(a, torch.full((16,), float(world.world_size)))
        ok = ok and torch.equal(b, torch.full((16,), float(world.world_size), dtype=b.dtype))
        return picky.calls, ok
    finally:
        comm.unregister_algorithm("picky")
        for name, impl in others.items():
            comm.register_algorithm(name, impl)


def test_auto_asks_supports_then_falls_back_to_backend(pools):
    assert pools(2).run(auto_selection) == [(1, True), (1, True)]
