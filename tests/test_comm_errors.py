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
        name, impl = registry.resolve("auto", FakeTensor(device), None)
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


def explicit_backend_still_agrees(world) -> int:
    from unittest import mock

    from ddpkit.comm import agreement

    real = agreement.agree_all_gather
    seen = []

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(agreement, "agree_all_gather", counted):
        comm.all_reduce(torch.ones(4), algo="backend")
        comm.all_reduce(torch.ones(4), algo="ring")
        comm.all_reduce(torch.ones(4), algo="backend", check=False)
    return len(seen)


def test_algorithms_without_an_in_band_channel_keep_the_agreement_all_gather(pools):
    # the test that proves counting works: the same patch sees the backend path's calls
    assert pools(2).run(explicit_backend_still_agrees) == [2, 2]
