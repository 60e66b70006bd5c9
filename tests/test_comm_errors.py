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


def _outcome_or_wrapped(fn) -> str:
    """_outcome, also for a future whose CommError comes back wrapped by torch."""
    try:
        return _outcome(fn)
    except RuntimeError as err:
        return f"CommError: {err}" if "CommError" in str(err) else f"RuntimeError: {err}"


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
        # both take the agreement all-gather, whose row names the algorithm
        fn = lambda: comm.all_reduce(torch.ones(8), algo="backend" if r == last else "ring")
    elif case == "root":
        fn = lambda: comm.broadcast(torch.ones(8), src=r % 2)
    elif case == "collective":
        fn = (lambda: comm.broadcast(torch.ones(8), 0)) if r == last else (
            lambda: comm.all_reduce(torch.ones(8)))
    elif case == "unknown_algo_on_one_rank":
        # a rank that cannot resolve its algorithm takes the agreement all-gather, so its
        # peers must be on that path too (the ring is) to hear of it
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
        "complex_max": lambda: comm.all_reduce(torch.ones(8, dtype=torch.complex64), op="max"),
        "complex_reduce_scatter": lambda: comm.reduce_scatter(
            torch.zeros(2, dtype=torch.complex64), torch.ones(2 * p, dtype=torch.complex64)),
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
    "complex_max": "does not support 'max' on complex tensors",
    "complex_reduce_scatter": "summed by all_reduce only",
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


# -- algo="auto": decided once per group and device type ------------------------------


@pytest.mark.parametrize(("device_type", "same_host", "world_size", "extra", "want"), [
    ("cpu", True, 2, {}, "shm"),
    ("cpu", True, 4, {}, "shm"),
    ("cpu", False, 4, {"max_local": 2}, "hierarchical"),
    ("cpu", False, 4, {"max_local": 1}, "backend"),  # one rank per host: nothing to share
    ("cpu", True, 1, {}, "backend"),  # nothing to move
    ("cpu", True, 2, {"shm_ok": False}, "backend"),  # no usable /dev/shm on some rank
    ("cuda", True, 2, {}, "backend"),  # NCCL
    ("cuda", False, 8, {"max_local": 4}, "backend"),
    ("mps", True, 2, {}, "backend"),
    ("meta", True, 2, {}, "backend"),
])
def test_choose_algo(device_type, same_host, world_size, extra, want):
    from ddpkit.comm.auto import choose_algo

    assert choose_algo(device_type, same_host, world_size, **extra) == want


class FakeTensor:
    """Only a device: the dispatch looks at nothing else (a CUDA tensor without a GPU)."""

    def __init__(self, device: str):
        self.device = torch.device(device)


def auto_dispatch(world) -> dict:
    from ddpkit.comm import auto, registry

    auto.forget()
    out = {}
    for device in ("cuda:0", "cuda:1", "cpu", "mps"):
        name, impl = registry.resolve_algo("auto", FakeTensor(device), None)
        out[device] = (name, type(impl).__name__)
    out["algo_for(cuda string)"] = auto.algo_for(None, "cuda")
    out["algo_for(cpu tensor)"] = auto.algo_for(None, torch.ones(1))
    return out


def test_auto_dispatch_cuda_to_backend_cpu_to_shm(pools):
    for result in pools(2).run(auto_dispatch):
        assert result["cuda:0"] == ("backend", "BackendAlgorithm")
        assert result["cuda:1"] == ("backend", "BackendAlgorithm")
        assert result["mps"] == ("backend", "BackendAlgorithm")
        assert result["cpu"] == ("shm", "ShmAlgorithm")
        assert result["algo_for(cuda string)"] == "backend"
        assert result["algo_for(cpu tensor)"] == "shm"


def fake_hosts_dispatch(world, per_host: int) -> tuple[str, str]:
    import os

    from ddpkit.comm import auto

    before = os.environ.get("DDPKIT_HOST_ID")
    os.environ["DDPKIT_HOST_ID"] = f"fake-host-{world.rank // per_host}"
    auto.forget()
    try:
        return auto.algo_for(None, "cpu"), auto.algo_for(None, "cuda")
    finally:
        auto.forget()
        if before is None:
            del os.environ["DDPKIT_HOST_ID"]
        else:
            os.environ["DDPKIT_HOST_ID"] = before


def test_auto_across_fake_hosts_is_hierarchical_or_backend(pools):
    assert pools(4).run(fake_hosts_dispatch, 2) == [("hierarchical", "backend")] * 4
    assert pools(2).run(fake_hosts_dispatch, 1) == [("backend", "backend")] * 2


def steady_state_backend_calls(world) -> dict:
    """One single-host CPU training step's collectives with no arguments but tensors,
    after a warm-up: count every torch.distributed call they make."""
    from unittest import mock

    from ddpkit.comm import agreement

    p, r = world.world_size, world.rank

    def step() -> list[torch.Tensor]:
        bucket = torch.arange(3000.0) * (r + 1)  # gradient bucket reduction
        comm.all_reduce(bucket, op="avg")
        buffers = torch.full((7,), float(r))  # buffer broadcast
        comm.broadcast(buffers, src=0)
        stop = torch.tensor([int(r == 1)], dtype=torch.int32)  # per-step stop/save agreement
        comm.all_reduce(stop, op="max")
        metric = torch.tensor([float(r)])  # metric reduction
        comm.reduce(metric, dst=0)
        shards = torch.empty(4)
        comm.reduce_scatter(shards, torch.ones(4 * p))
        gathered = torch.empty(2 * p)
        comm.all_gather(gathered, torch.full((2,), float(r)))
        comm.barrier()
        return [bucket, buffers, stop, metric, shards, gathered]

    step()  # warm-up: the host exchange and the segment set-up happen here
    calls: dict[str, int] = {}
    patches = []
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier",
                 "reduce", "isend", "irecv", "send", "recv", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single"):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        patches.append(mock.patch.object(dist, name, counted))
    real_agree = agreement.agree_all_gather

    def counted_agree(*args, **kwargs):
        calls["agreement"] = calls.get("agreement", 0) + 1
        return real_agree(*args, **kwargs)

    patches.append(mock.patch.object(agreement, "agree_all_gather", counted_agree))
    for patch in patches:
        patch.start()
    try:
        out = step()
    finally:
        for patch in patches:
            patch.stop()
    want = [
        torch.arange(3000.0) * sum(range(1, p + 1)) / p,
        torch.zeros(7),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([float(sum(range(p)))]) if r == 0 else torch.tensor([float(r)]),
        torch.full((4,), float(p)),
        torch.arange(p).repeat_interleave(2).float(),
    ]
    return {"calls": calls, "ok": [torch.equal(a, b) for a, b in zip(out, want)]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_single_host_cpu_step_makes_no_backend_call(pools, world_size):
    for result in pools(world_size).run(steady_state_backend_calls):
        assert result["ok"] == [True] * 6
        assert result["calls"] == {}


def _count_agreement_all_gathers(fn) -> int:
    """How many agreement all-gathers ``fn()`` makes on this rank."""
    from unittest import mock

    from ddpkit.comm import agreement

    real = agreement.agree_all_gather
    seen = []

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(agreement, "agree_all_gather", counted):
        fn()
    return len(seen)


def agreement_all_gathers_per_algo(world) -> dict:
    p = world.world_size

    def every_collective(algo: str, **kw):
        def run() -> None:
            comm.all_reduce(torch.ones(4), algo=algo, **kw)
            comm.all_reduce(torch.ones(4), op="avg", algo=algo, **kw)
            comm.reduce_scatter(torch.empty(2), torch.ones(2 * p), algo=algo, **kw)
            comm.all_gather(torch.empty(2 * p), torch.ones(2), algo=algo, **kw)
            comm.broadcast(torch.ones(4), 0, algo=algo, **kw)
            comm.reduce(torch.ones(4), 0, algo=algo, **kw)
            comm.barrier(algo=algo, **kw)
            comm.all_reduce(torch.ones(4), algo=algo, async_op=True, **kw).wait()
        return run

    return {
        "backend": _count_agreement_all_gathers(every_collective("backend")),
        "backend check=False": _count_agreement_all_gathers(
            every_collective("backend", check=False)),
        "ring": _count_agreement_all_gathers(every_collective("ring")),
        "naive_ring": _count_agreement_all_gathers(every_collective("naive_ring")),
        "ring check=False": _count_agreement_all_gathers(every_collective("ring", check=False)),
        "auto": _count_agreement_all_gathers(every_collective("auto")),
    }


def test_algorithms_without_an_in_band_channel_keep_the_agreement_all_gather(pools):
    # one all-gather per call (the barrier included) for the backend and the rings, none
    # with check=False, none for "auto" (shm, which checks inside its own barrier)
    for counts in pools(2).run(agreement_all_gathers_per_algo):
        assert counts == {"backend": 8, "backend check=False": 0, "ring": 8, "naive_ring": 8,
                          "ring check=False": 0, "auto": 0}


# -- ring mismatches and refusals (caught by the agreement all-gather) ---------------------


def _ring_still_works(world) -> bool:
    """The group is clean: ring calls (sync, then async on the lane) give torch's values."""
    x = torch.arange(1000, dtype=torch.float32) * (world.rank + 1)
    want = x.clone()
    dist.all_reduce(want)
    comm.all_reduce(x, algo="ring")
    b = torch.full((300,), float(world.rank))
    comm.broadcast(b, world.world_size - 1, algo="ring")
    y = torch.arange(77, dtype=torch.float32) + world.rank
    want_y = y.clone()
    dist.all_reduce(want_y)
    comm.all_reduce(y, algo="ring", async_op=True).wait()
    return (torch.equal(x, want) and torch.equal(b, torch.full((300,), world.world_size - 1.0))
            and torch.equal(y, want_y))


def ring_mismatch(world, case: str) -> tuple[str, bool]:
    r, p = world.rank, world.world_size
    last = r == p - 1
    ring = {"algo": "ring"}
    fn = {
        # every rank a different size: each must learn every row
        "size": lambda: comm.all_reduce(torch.ones(1000 + r), **ring),
        "empty_vs_not": lambda: comm.all_reduce(torch.ones(0 if last else 5), **ring),
        "dtype": lambda: comm.all_reduce(
            torch.ones(8, dtype=torch.float64 if last else torch.float32), **ring),
        "op": lambda: comm.all_reduce(torch.ones(8), op="max" if last else "sum", **ring),
        "broadcast_root": lambda: comm.broadcast(torch.ones(8), src=r, **ring),
        "reduce_root": lambda: comm.reduce(torch.ones(8), dst=int(last), **ring),
        "collective": (lambda: comm.broadcast(torch.ones(8), 0, **ring)) if last else (
            lambda: comm.all_reduce(torch.ones(8), **ring)),
        "barrier_vs_all_reduce": (lambda: comm.barrier(**ring)) if last else (
            lambda: comm.all_reduce(torch.ones(1, dtype=torch.int32), **ring)),
        "algo": lambda: comm.all_reduce(torch.ones(8), algo="naive_ring" if last else "ring"),
        "all_gather_size": lambda: comm.all_gather(
            torch.zeros((4 + last) * p), torch.ones(4 + last), **ring),
        "reduce_scatter_size": lambda: comm.reduce_scatter(
            torch.zeros(3 + last), torch.ones((3 + last) * p), **ring),
        "async_size": lambda: comm.all_reduce(
            torch.ones(100 + last), async_op=True, **ring).wait(),
    }[case]
    return _outcome_or_wrapped(fn), _ring_still_works(world)


def _expected(case: str, p: int) -> list[str]:
    """Substrings every rank's message must hold: the same verdict, every rank's row."""
    other = f"rank {p - 1}: "
    return {
        "size": [f"rank {r}: {1000 + r} x float32" for r in range(p)],
        "empty_vs_not": ["rank 0: 5 x float32", other + "0 x float32"],
        "dtype": ["rank 0: 8 x float32", other + "8 x float64"],
        "op": ["rank 0: 8 x float32, algo=ring, op=sum", other + "8 x float32, algo=ring, op=max"],
        "broadcast_root": [f"rank {r}: 8 x float32, algo=ring, root={r}" for r in range(p)],
        "reduce_root": ["root=0", other + "8 x float32, algo=ring, op=sum, root=1"],
        "collective": ["rank 0: all_reduce 8 x float32", other + "broadcast 8 x float32"],
        "barrier_vs_all_reduce": ["rank 0: all_reduce 1 x int32", other + "barrier 0 x -"],
        "algo": ["rank 0: 8 x float32, algo=ring,", other + "8 x float32, algo=naive_ring"],
        "all_gather_size": [f"rank 0: 4->{4 * p} x float32", f"{other}5->{5 * p} x float32"],
        "reduce_scatter_size": [f"rank 0: {3 * p}->3 x float32", f"{other}{4 * p}->4 x float32"],
        "async_size": ["rank 0: 100 x float32", other + "101 x float32"],
    }[case]


RING_MISMATCHES = ("size", "empty_vs_not", "dtype", "op", "broadcast_root", "reduce_root",
                   "collective", "barrier_vs_all_reduce", "algo", "all_gather_size",
                   "reduce_scatter_size", "async_size")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", RING_MISMATCHES)
def test_ring_mismatch_is_the_same_error_on_every_rank(pools, case, world_size):
    results = pools(world_size).run(ring_mismatch, case, timeout=60)
    for rank, (outcome, still_works) in enumerate(results):
        assert outcome.startswith("CommError") and "differ across ranks" in outcome, (
            rank, outcome)
        for part in _expected(case, world_size):
            assert part in outcome, (rank, part, outcome)
        assert still_works, f"rank {rank}: ring calls went wrong after the refusal"


def ring_local_refusal(world, case: str) -> tuple[str, bool]:
    r, p = world.rank, world.world_size
    last = r == p - 1
    fn = {
        "band_on_float": lambda: comm.all_reduce(
            torch.ones(8), op="band" if last else "sum", algo="ring"),
        "root_outside": lambda: comm.broadcast(torch.ones(8), src=p + 3 if last else 0,
                                               algo="ring"),
        "async": lambda: comm.all_gather(
            torch.zeros(2 * p), torch.ones(2, dtype=torch.int16 if last else torch.float32),
            algo="ring", async_op=True).wait(),
    }[case]
    return _outcome_or_wrapped(fn), _ring_still_works(world)


RING_REFUSALS = {
    "band_on_float": "needs an integer tensor",
    "root_outside": "not a member",
    "async": "dtype",
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(RING_REFUSALS))
def test_ring_local_refusal_on_one_rank(pools, case, world_size):
    results = pools(world_size).run(ring_local_refusal, case, timeout=60)
    *peers, (own, own_works) = results
    assert own.startswith("CommError") and RING_REFUSALS[case] in own, own
    assert own_works
    for rank, (outcome, still_works) in enumerate(peers):
        assert outcome.startswith("CommError"), (rank, outcome)
        assert f"group rank(s) {world_size - 1} refused the call" in outcome, (rank, outcome)
        assert still_works, rank


def ring_op_mismatch_without_the_verdict(world) -> tuple[str, list[float]]:
    """The control for the tests above: with the agreement's verdict switched off, a ring
    op mismatch runs (both rings move the same bytes) and returns wrong values, so the
    CommError they see comes from the agreement, nothing else."""
    from unittest import mock

    from ddpkit.comm import agreement

    x = torch.tensor([1.0 + world.rank, 10.0])
    with mock.patch.object(agreement, "verdict", lambda *args, **kwargs: None):
        outcome = _outcome(lambda: comm.all_reduce(
            x, op="max" if world.rank == 1 else "sum", algo="ring"))
    return outcome, x.tolist()


def test_ring_agreement_is_what_catches_a_mismatch(pools):
    (out0, x0), (out1, x1) = pools(2).run(ring_op_mismatch_without_the_verdict)
    assert out0 == out1 == "ok"
    # neither the sum [3, 20] nor the max [2, 10]: half of each, silently
    for x in (x0, x1):
        assert x not in ([3.0, 20.0], [2.0, 10.0]), x


def ring_results_are_identical(world) -> list[list[int]]:
    """Floats whose sum depends on the order: every rank must still get the same bits
    (the ring reduces each chunk once and passes the result on)."""
    g = torch.Generator().manual_seed(world.rank)
    x = torch.randn(1000, generator=g, dtype=torch.float32) * 10 ** torch.randint(
        -6, 6, (1000,), generator=g)
    comm.all_reduce(x, op="avg", algo="ring")
    bits = x.view(torch.int32)
    table = [torch.empty_like(bits) for _ in range(world.world_size)]
    dist.all_gather(table, bits)
    return [int(t.sum()) for t in table] + [int((table[0] != t).sum()) for t in table]


def test_ring_gives_every_rank_the_same_bits(pools):
    for out in pools(3).run(ring_results_are_identical, timeout=60):
        assert out[3:] == [0, 0, 0], out


def ring_mismatch_leaves_tensors(world) -> list[str]:
    """A mismatch raises before any result is written."""
    r, bad = world.rank, []
    x = torch.full((8,), float(r))
    outcome = _outcome(lambda: comm.all_reduce(x, op="max" if r else "sum", algo="ring"))
    if "differ across ranks" not in outcome or not torch.equal(x, torch.full((8,), float(r))):
        bad.append(f"all_reduce: {outcome} {x.tolist()}")
    out = torch.full((2 * (2 + r),), -1.0)
    outcome = _outcome(lambda: comm.all_gather(out, torch.ones(2 + r), algo="ring"))
    if "differ across ranks" not in outcome or not bool((out == -1).all()):
        bad.append(f"all_gather: {outcome} {out.tolist()}")
    return bad


def test_ring_mismatch_leaves_every_tensor_untouched(pools):
    assert pools(2).run(ring_mismatch_leaves_tensors, timeout=60) == [[], []]


def ring_empty_and_avg(world) -> list[str]:
    """Empty tensors still do nothing, through the ring (agreement all-gather) and
    "auto" (shm, whose in-band check must meet a peer's even with 0 elements); "avg" is
    right on both (the public layer divides the ring's sum, shm divides itself)."""
    p, bad = world.world_size, []
    for algo in ("ring", "auto"):
        e = torch.empty(0)
        comm.all_reduce(e, algo=algo)
        comm.broadcast(e, 0, algo=algo)
        comm.reduce(e, 0, algo=algo)
        comm.all_gather(torch.empty(0), e, algo=algo)
        comm.reduce_scatter(torch.empty(0), e, algo=algo)
        x = torch.arange(10, dtype=torch.float32) * (world.rank + 1)
        comm.all_reduce(x, op="avg", algo=algo)
        want = torch.arange(10, dtype=torch.float32) * sum(range(1, p + 1)) / p
        if not torch.equal(x, want):
            bad.append(f"{algo} avg")
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_empty_tensors_and_avg_through_ring_and_auto(pools, world_size):
    assert pools(world_size).run(ring_empty_and_avg, timeout=60) == [[]] * world_size


# -- a registered in-band algorithm: the signature's row() and verdict() -----------------


class RowsInBand:
    """The smallest in-band algorithm: it exchanges the signature rows itself (here by
    torch's all_gather_object, standing in for an algorithm's own messages) and lets
    ``verdict`` judge them before touching the tensor."""

    def in_band(self, group) -> bool:
        return True

    def _rows(self, signature, group) -> None:
        rows = [None] * dist.get_world_size(group)
        dist.all_gather_object(rows, signature.row(), group=group)
        signature.verdict(rows)

    def refuse(self, signature, group=None) -> None:
        self._rows(signature, group)

    def all_reduce(self, tensor, op, group=None, *, signature=None):
        self._rows(signature, group)
        if tensor.numel():
            dist.all_reduce(tensor, comm.ops.TO_REDUCE_OP["sum" if op == "avg" else op],
                            group=group)
            if op == "avg":  # in-band algorithms get avg and divide themselves
                tensor.div_(dist.get_world_size(group))


def registered_in_band(world) -> list[str]:
    comm.register_algorithm("rows_in_band", RowsInBand(), replace=True)
    r, p = world.rank, world.world_size
    x = torch.full((4,), float(r + 1))
    comm.all_reduce(x, op="avg", algo="rows_in_band")
    out = [str(x.tolist() == [sum(range(1, p + 1)) / p] * 4)]
    y = torch.ones(3 + r)
    # check=False does not skip an in-band check (it is part of the call's own exchange)
    out.append(_outcome(lambda: comm.all_reduce(y, algo="rows_in_band", check=False)))
    out.append(_outcome(lambda: comm.all_reduce(
        torch.ones(2), op="band" if r == p - 1 else "sum", algo="rows_in_band")))
    return out


def test_a_registered_in_band_algorithm_checks_with_row_and_verdict(pools):
    results = pools(2).run(registered_in_band, timeout=60)
    for rank, (avg_ok, size, _) in enumerate(results):
        assert avg_ok == "True", (rank, results)
        # the same verdict on every rank, naming every rank's size
        assert "differ across ranks" in size and "rank 0: 3 x float32" in size, size
        assert "rank 1: 4 x float32" in size, size
    assert "needs an integer tensor" in results[1][2], results
    assert "group rank(s) 1 refused the call" in results[0][2], results
