"""Shared-memory all-reduce: results against torch's own collectives, the hierarchical
variant on faked hosts, the comm hook in training, and the segment life cycle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from ddpkit.comm import ops
from ddpkit.comm.shm import segment as shm_segment
from ddpkit.errors import CommError

SIZES = (0, 1, 7, 1000, 40_001)  # empty, one, not divisible by W, small path, slotted path
SLOT_MB = 0.02  # tiny slots: tensors above SMALL_BYTES go through them in many pieces


def _segments(run: str) -> list[str]:
    return [n for n in os.listdir(shm_segment.SHM_DIR) if n.startswith(shm_segment.run_prefix(run))]


def _input(rank: int, numel: int, dtype: torch.dtype, op: str, shape_seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + shape_seed)
    if dtype.is_floating_point:
        # products of a few values near 1 stay finite even in float16
        base = 1 + 0.1 * torch.randn(numel, generator=g) if op == "product" else torch.randn(
            numel, generator=g)
        return base.to(dtype)
    high = 4 if op == "product" else 120
    return torch.randint(0, high, (numel,), generator=g, dtype=torch.int64).to(dtype)



def _reduce_both_ways(comm, buffer, x, op):
    """torch's result for ``x``, and ours on a private copy and on a copy in ``buffer``
    (allocated in the segment: the in-place path DataParallel's buckets take)."""
    expected = x.clone()
    dist.all_reduce(expected, ops.TO_REDUCE_OP["sum" if op == "avg" else op])
    if op == "avg":
        expected = expected / dist.get_world_size()
    private = x.clone()
    comm.all_reduce(private, op)
    shared = buffer[: x.numel()]
    shared.copy_(x)
    comm.all_reduce(shared, op)
    return expected, private, shared

def _close(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str) -> bool:
    if not a.dtype.is_floating_point or op in ("min", "max"):
        return torch.equal(a, b)
    if world_size == 2 and op in ("sum", "avg"):  # a + b == b + a exactly
        return torch.equal(a, b)
    tol = {torch.float16: 1e-2, torch.bfloat16: 4e-2}.get(a.dtype, 1e-5)
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


def grid_vs_torch(world, sizes) -> tuple[int, list]:
    from ddpkit.comm.shm import ShmCommunicator

    checks, failures = 0, []
    with ShmCommunicator(slot_mb=SLOT_MB, timeout=60) as comm:
        for dtype in ops.DTYPES:
            # one allocation per dtype, reduced through slices: allocating is a collective
            buffer = comm.allocate(max(sizes), dtype)
            for op in ops.OPS:
                try:
                    ops.check_op(op, dtype)
                except CommError:
                    continue
                for numel in sizes:
                    x = _input(world.rank, numel, dtype, op, numel)
                    expected, private, shared = _reduce_both_ways(comm, buffer, x, op)
                    for path, got in (("private", private), ("allocated", shared)):
                        checks += 1
                        if not _close(got, expected, world.world_size, op):
                            failures.append((str(dtype), op, numel, path))
    return checks, failures


@pytest.mark.parametrize(("world_size", "sizes"), [(2, SIZES), (3, (0, 7, 40_001))])
def test_every_dtype_op_and_size_matches_torch(pools, world_size, sizes):
    results = pools(world_size).run(grid_vs_torch, sizes)
    for checks, failures in results:
        assert checks > 100
        assert failures == []


def shapes_and_views(world) -> list[bool]:
    from ddpkit.comm.shm import ShmCommunicator

    out = []
    with ShmCommunicator(slot_mb=SLOT_MB) as comm:
        matrix = torch.arange(12.0).reshape(3, 4) * (world.rank + 1)
        expected = torch.arange(12.0).reshape(3, 4) * sum(r + 1 for r in range(world.world_size))
        transposed = matrix.t()  # not contiguous: reduced through a copy, written back
        comm.all_reduce(transposed)
        out.append(torch.equal(matrix, expected))
        scalar = torch.tensor(float(world.rank))
        comm.all_reduce(scalar, dist.ReduceOp.MAX)  # torch's op enum is accepted too
        out.append(scalar.item() == world.world_size - 1)
        bucket = comm.allocate(100, torch.float32)
        bucket.fill_(world.rank)
        comm.all_reduce(bucket[10:30], "sum")  # a slice of an allocation is reduced in place
        out.append(bool((bucket[10:30] == sum(range(world.world_size))).all()))
        out.append(bool((bucket[:10] == world.rank).all() and (bucket[30:] == world.rank).all()))
        # One rank's tensor in shared memory, the others' private (a joined rank's
        # stand-in): every rank must take the same (copying) path.
        shared = comm.allocate(40_001, torch.float32)  # collective: every rank allocates
        big = shared if world.rank == 0 else torch.empty(40_001)
        big.copy_(torch.arange(40_001.0) * (world.rank + 1))
        comm.all_reduce(big)
        expected = torch.arange(40_001.0) * sum(r + 1 for r in range(world.world_size))
        out.append(torch.equal(big, expected))
    return out


def test_shapes_views_and_slices(pools):
    for flags in pools(2).run(shapes_and_views):
        assert flags == [True] * 5


def mismatched_calls(world) -> list[str]:
    from ddpkit.comm.shm import ShmCommunicator

    messages = []
    with ShmCommunicator(timeout=60) as comm:
        for numel in (10 + world.rank, 50_000 + world.rank):  # small path, slotted path
            try:
                comm.all_reduce(torch.ones(numel))
            except CommError as exc:
                messages.append(str(exc))
        after = torch.ones(5)  # the communicator is still in step after the error
        comm.all_reduce(after)
        messages.append(after.tolist())
    return messages


def test_ranks_disagreeing_on_the_call_get_an_error_not_a_hang(pools):
    for messages in pools(2).run(mismatched_calls):
        assert len(messages) == 3
        assert all("all_reduce arguments differ across ranks" in m for m in messages[:2])
        assert all("rank 0: 10 x float32" in m and "rank 1: 11 x float32" in m
                   for m in messages[:1])
        assert messages[2] == [2.0] * 5


def _reference(collective: str, x: torch.Tensor, op: str, root: int, p: int) -> torch.Tensor:
    """torch's answer for one rank: built from dist.all_reduce / all_gather_object only."""
    r = dist.get_rank()
    if collective == "broadcast":
        ref = x.clone()
        dist.broadcast(ref, root)
        return ref
    if collective == "all_gather":
        parts: list = [None] * p
        dist.all_gather_object(parts, x)
        return torch.cat(parts)
    total = x.clone()
    dist.all_reduce(total, ops.TO_REDUCE_OP["sum" if op == "avg" else op])
    if op == "avg":
        total = total / p
    if collective == "reduce_scatter":
        m = x.numel() // p
        return total[r * m:(r + 1) * m]
    return total if r == root else x  # reduce: only the root's tensor changes


def _run_collective(comm, collective: str, x: torch.Tensor, op: str, root: int, p: int):
    if collective == "broadcast":
        y = x.clone()
        comm.broadcast(y, root)
        return y
    if collective == "all_gather":
        y = torch.full((x.numel() * p,), 99, dtype=x.dtype)
        comm.all_gather(y, x)
        return y
    if collective == "reduce_scatter":
        y = torch.full((x.numel() // p,), 99, dtype=x.dtype)
        comm.reduce_scatter(y, x, op)
        return y
    y = x.clone()
    comm.reduce(y, root, op)
    return y


SHM_COLLECTIVES = ("broadcast", "all_gather", "reduce_scatter", "reduce")


def collectives_grid(world, sizes, dtypes) -> tuple[int, list]:
    """Every shm collective, dtype, op and size (tiny slots: many pieces) against torch."""
    from ddpkit.comm.shm import ShmCommunicator

    p, checks, failures = world.world_size, 0, []
    with ShmCommunicator(slot_mb=SLOT_MB, timeout=60) as comm:
        for collective in SHM_COLLECTIVES:
            for dtype in dtypes:
                opnames = ["-"] if collective in ("broadcast", "all_gather") else [
                    o for o in ("sum", "avg", "max", "min", "product")
                    if dtype.is_floating_point or o != "avg"]
                for op in opnames:
                    for numel in sizes:
                        n = numel * p if collective == "reduce_scatter" else numel
                        root = (numel + 1) % p
                        x = _input(world.rank, n, dtype, "sum" if op == "-" else op, numel)
                        want = _reference(collective, x, op, root, p)
                        got = _run_collective(comm, collective, x, op, root, p)
                        checks += 1
                        if not _close(got, want, p, "min" if op == "-" else op):
                            failures.append((collective, str(dtype), op, numel))
        comm.barrier()
    return checks, failures


@pytest.mark.parametrize(("world_size", "sizes", "dtypes"), [
    (2, (0, 1, 7, 1000, 40_001), (torch.float32, torch.float64, torch.bfloat16, torch.int64)),
    (3, (0, 7, 40_001), (torch.float32, torch.int32)),
    (4, (0, 5, 12_345), (torch.float32, torch.bfloat16)),
])
def test_broadcast_gather_scatter_reduce_match_torch(pools, world_size, sizes, dtypes):
    for checks, failures in pools(world_size).run(collectives_grid, sizes, dtypes):
        assert checks > 40
        assert failures == []


def public_default_grid(world) -> tuple[int, list]:
    """The public API with no algo argument (auto: shm here), sizes past one slot half."""
    from ddpkit import comm as dcomm
    from ddpkit.comm import auto

    p, checks, failures = world.world_size, 0, []
    assert auto.algo_for(None, "cpu") == "shm"
    for numel in (0, 3, 40_001, 1_200_001):  # the last: > half a default slot (4 MiB)
        for dtype, op in ((torch.float32, "sum"), (torch.float64, "avg"), (torch.int64, "max")):
            x = _input(world.rank, numel, dtype, op, numel)
            want = _reference("reduce", x, op, dist.get_rank(), p)  # everyone's the root
            got = x.clone()
            dcomm.all_reduce(got, op)
            checks += 1
            if not _close(got, want, p, op):
                failures.append(("all_reduce", str(dtype), op, numel))
            for collective in SHM_COLLECTIVES:
                n = numel * p if collective == "reduce_scatter" else numel
                y = _input(world.rank, n, dtype, op, numel + 1)
                cop = "-" if collective in ("broadcast", "all_gather") else op
                want = _reference(collective, y, cop, p - 1, p)
                got = _run_collective(_Public(dcomm), collective, y, cop, p - 1, p)
                checks += 1
                if not _close(got, want, p, "min" if cop == "-" else op):
                    failures.append((collective, str(dtype), op, numel))
    dcomm.barrier()
    return checks, failures


class _Public:
    """ddpkit.comm with the ShmCommunicator's method signatures (for _run_collective)."""

    def __init__(self, dcomm):
        self.c = dcomm

    def broadcast(self, t, root):
        self.c.broadcast(t, root)

    def all_gather(self, out, x):
        self.c.all_gather(out, x)

    def reduce_scatter(self, out, x, op):
        self.c.reduce_scatter(out, x, op=op)

    def reduce(self, t, root, op):
        self.c.reduce(t, root, op=op)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_public_default_collectives_match_torch(pools, world_size):
    for checks, failures in pools(world_size).run(public_default_grid):
        assert checks == 60
        assert failures == []


def mismatched_collectives(world, case: str) -> tuple[str, bool]:
    """One rank (the last) calls differently; everything through the default (shm)."""
    from ddpkit import comm as dcomm

    p, r = world.world_size, world.rank
    odd = r == p - 1
    big = 1_200_001  # several slot halves: a rank going ahead alone would hang or abort
    calls = {
        "bcast_vs_gather": lambda: (dcomm.broadcast(torch.ones(big), 0) if odd else
                                    dcomm.all_gather(torch.empty(big * p), torch.ones(big))),
        "barrier_vs_all_reduce": lambda: (dcomm.barrier() if odd else
                                          dcomm.all_reduce(torch.ones(8))),
        "rs_size": lambda: dcomm.reduce_scatter(torch.empty(big + odd),
                                                torch.ones((big + odd) * p)),
        "ag_dtype": lambda: dcomm.all_gather(
            torch.empty(4 * p, dtype=torch.float64 if odd else torch.float32),
            torch.ones(4, dtype=torch.float64 if odd else torch.float32)),
        "bcast_root": lambda: dcomm.broadcast(torch.ones(big), int(odd)),
        "reduce_op": lambda: dcomm.reduce(torch.ones(9), 0, op="min" if odd else "max"),
        "refused_bcast": lambda: dcomm.broadcast(torch.ones(big), p + 3 if odd else 0),
        "refused_rs_shape": lambda: dcomm.reduce_scatter(torch.empty(5),
                                                         torch.ones(5 * p + odd)),
    }
    try:
        calls[case]()
        outcome = "ok"
    except CommError as err:
        outcome = f"CommError: {err}"
    x = torch.arange(big, dtype=torch.float32) * (r + 1)
    dcomm.all_reduce(x)
    still = torch.equal(x, torch.arange(big, dtype=torch.float32) * sum(range(1, p + 1)))
    y = torch.full((3,), float(r))
    dcomm.broadcast(y, p - 1)
    return outcome, still and torch.equal(y, torch.full((3,), float(p - 1)))


COLLECTIVE_MISMATCHES = {
    "bcast_vs_gather": "differ across ranks",
    "barrier_vs_all_reduce": "differ across ranks",
    "rs_size": "differ across ranks",
    "ag_dtype": "float64",
    "bcast_root": "root=",
    "reduce_op": "op=min",
    "refused_bcast": "refused the call",
    "refused_rs_shape": "refused the call",
}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(COLLECTIVE_MISMATCHES))
def test_mismatched_shm_collectives_raise_on_every_rank(pools, case, world_size):
    results = pools(world_size).run(mismatched_collectives, case, timeout=60)
    for rank, (outcome, still_works) in enumerate(results):
        assert outcome.startswith("CommError"), (rank, outcome)
        assert still_works, rank
    # every rank but a refusing one gives the same message, naming the difference
    others = {outcome for outcome, _ in results[:-1]}
    assert len(others) == 1 and COLLECTIVE_MISMATCHES[case] in others.pop(), results


def hierarchical(world, run) -> dict:
    from ddpkit.comm.shm import ShmCommunicator

    host = f"fake-host-{world.rank // 2}"  # ranks 0,1 on one "host", 2,3 on another
    out = {}
    with ShmCommunicator(host_id=host, slot_mb=SLOT_MB, run=run) as comm:
        out["hosts"] = comm.nhosts
        out["local"] = comm.local_size
        ok = []
        for op, dtype in (("sum", torch.float64), ("avg", torch.float32), ("max", torch.int64),
                          ("bxor", torch.int32), ("product", torch.float64)):
            buffer = comm.allocate(40_001, dtype)
            for numel in (0, 7, 40_001):
                x = _input(world.rank, numel, dtype, op, numel)
                expected, private, shared = _reduce_both_ways(comm, buffer, x, op)
                ok.append(_close(private, expected, 4, op) and _close(shared, expected, 4, op))
        out["ok"] = ok
    return out


def test_hierarchical_across_fake_hosts_matches_torch(pools):
    for result in pools(4).run(hierarchical, f"t{uuid.uuid4().hex[:8]}"):
        assert result["hosts"] == 2 and result["local"] == 2
        assert len(result["ok"]) == 15 and all(result["ok"])


def public_on_fake_hosts(world) -> dict:
    """ddpkit.comm with no algo argument on a group whose ranks claim two hosts: auto picks
    "hierarchical" (shm inside a host, the backend between host leaders)."""
    from ddpkit import comm as dcomm
    from ddpkit.comm import auto

    p, r = world.world_size, world.rank
    before = os.environ.get("DDPKIT_HOST_ID")
    os.environ["DDPKIT_HOST_ID"] = f"fake-host-{r // 2}"
    try:
        group = dcomm.new_group(list(range(p)))  # fresh group: fresh decision and communicator
        out = {"algo": auto.algo_for(group, "cpu"), "ok": []}
        for numel in (0, 7, 1_200_001):
            for dtype, op in ((torch.float64, "sum"), (torch.float32, "avg"), (torch.int64, "max")):
                x = _input(r, numel, dtype, op, numel)
                want = x.clone()
                dist.all_reduce(want, ops.TO_REDUCE_OP["sum" if op == "avg" else op])
                if op == "avg":
                    want = want / p
                got = x.clone()
                dcomm.all_reduce(got, op, group=group)
                out["ok"].append(_close(got, want, p, op))
        y = torch.full((5,), float(r))
        dcomm.broadcast(y, p - 1, group=group)
        out["ok"].append(torch.equal(y, torch.full((5,), float(p - 1))))
        gathered = torch.empty(2 * p)
        dcomm.all_gather(gathered, torch.full((2,), float(r)), group=group)
        out["ok"].append(torch.equal(gathered, torch.arange(p).repeat_interleave(2).float()))
        shard = torch.empty(3)
        dcomm.reduce_scatter(shard, torch.ones(3 * p), group=group)
        out["ok"].append(torch.equal(shard, torch.full((3,), float(p))))
        dcomm.barrier(group=group)
        try:  # no shared memory spans hosts: the agreement all-gather catches this
            dcomm.all_reduce(torch.ones(10 + (r == p - 1)), group=group)
            out["mismatch"] = "ok"
        except CommError as err:
            out["mismatch"] = str(err)
        return out
    finally:
        if before is None:
            del os.environ["DDPKIT_HOST_ID"]
        else:
            os.environ["DDPKIT_HOST_ID"] = before


def test_public_default_is_hierarchical_across_fake_hosts(pools):
    for result in pools(4).run(public_on_fake_hosts):
        assert result["algo"] == "hierarchical"
        assert result["ok"] == [True] * 12
        assert "rank 3: 11 x float32" in result["mismatch"]


# ---------------------------------------------------------------- registry face, hook


def registry_functions(world) -> list:
    from ddpkit.comm import shm

    x = torch.full((1000,), float(world.rank + 1))
    shm.group_communicator().all_reduce(x, "avg")
    cpu_ok = shm.supports(torch.ones(3))
    return [x[0].item(), cpu_ok, shm.group_communicator() is not None]


def test_group_communicator_and_supports(pools):
    for mean, supported, has_comm in pools(2).run(registry_functions):
        assert mean == 1.5 and supported and has_comm


def hook_training(world, steps) -> list[float]:
    """torch DDP with the shm hook against torch DDP with its own all-reduce: the same
    parameters after a few steps of SGD, and identical across ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.comm.shm.hook import ShmState, shm_hook

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))

    reference, ours = DDP(make()), DDP(make(), bucket_cap_mb=0.005)  # several buckets
    state = ShmState(slot_mb=SLOT_MB)
    # Without shared memory the hook warns and reduces through gloo, which trains the same:
    # count what actually goes through the shm communicator (created collectively here
    # rather than at the first bucket).
    comm = state.communicator
    assert comm is not None, "the shm hook fell back to the backend's all_reduce"
    reduced = []  # numel of every tensor the shm communicator reduced
    shm_all_reduce = comm.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        reduced.append(tensor.numel())
        return shm_all_reduce(tensor, *args, **kwargs)

    comm.all_reduce = counting_all_reduce
    ours.register_comm_hook(state, shm_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, ours)]
    g = torch.Generator().manual_seed(world.rank)
    for _ in range(steps):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 3, (16,), generator=g)
        for model, opt in zip((reference, ours), opts):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    still_shm = state.communicator is comm
    state.close()
    # torch's max keeps a NaN (Python's max over floats drops one that is not first).
    diff = torch.stack([(a - b).abs().max() for a, b in
                        zip(reference.parameters(), ours.parameters())]).max().item()
    flat = torch.cat([p.detach().flatten() for p in ours.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, dist.ReduceOp.MAX)
    gradients = steps * sum(p.numel() for p in ours.parameters())
    return [diff, (spread - flat).abs().max().item(), still_shm, sum(reduced), gradients]


def test_shm_hook_trains_like_torch_ddp(pools):
    for diff, spread, still_shm, through_shm, gradients in pools(2).run(hook_training, 5):
        assert diff < 1e-5  # same math, summation order may differ in the last bit
        assert spread == 0.0  # every rank holds bit-identical parameters
        assert still_shm and through_shm == gradients  # every gradient went through shm


def state_allocates_shared_buckets(world) -> list:
    from ddpkit.comm.shm.hook import ShmState, shm_hook

    state = ShmState()
    bucket_storage = state.allocate(1000, torch.float32, "cpu")
    in_shm = state.communicator._find(bucket_storage) is not None

    class Bucket:  # what the engine hands a hook (torch's GradBucket interface)
        def buffer(self):
            return bucket_storage

    bucket_storage.fill_(float(world.rank))
    result = shm_hook(state, Bucket()).wait()
    state.close()
    return [in_shm, result.data_ptr() == bucket_storage.data_ptr(), result[0].item()]


def test_state_allocates_buckets_in_shared_memory(pools):
    for in_shm, same_storage, mean in pools(2).run(state_allocates_shared_buckets):
        assert in_shm and same_storage and mean == 0.5


# ---------------------------------------------------------------- life cycle


def create_then_report(world, run) -> list:
    from ddpkit.comm.shm import ShmCommunicator

    comm = ShmCommunicator(run=run)
    comm.allocate(10_000, torch.float32)
    dist.barrier()  # the leader unlinks just after its peers attached: let it finish
    left_while_open = _segments(run)
    comm.close()
    return [left_while_open, _segments(run)]


def test_segments_are_unlinked_once_everyone_attached(pools):
    run = f"t{uuid.uuid4().hex[:8]}"
    for while_open, after_close in pools(2).run(create_then_report, run):
        assert while_open == [] and after_close == []


def too_big(world, run) -> list:
    from ddpkit.comm.shm import ShmCommunicator

    free = os.statvfs(shm_segment.SHM_DIR)
    slot_mb = 4 * free.f_bavail * free.f_frsize / 2**20  # more than /dev/shm has
    try:
        ShmCommunicator(slot_mb=slot_mb, run=run)
        error = ""
    except CommError as exc:
        error = str(exc)
    # The hook's state falls back to the backend and training goes on.
    from ddpkit.comm.shm.hook import ShmState

    state = ShmState(slot_mb=slot_mb, run=run)
    x = torch.full((10,), float(world.rank))
    state.all_reduce(x, "sum")
    fell_back = state.communicator is None
    dist.barrier()
    return [error, fell_back, x[0].item(), _segments(run)]


def test_too_little_shared_memory_is_a_clear_error_or_a_fallback(pools):
    run = f"t{uuid.uuid4().hex[:8]}"
    for error, fell_back, value, left in pools(2).run(too_big, run):
        assert "cannot reserve" in error and "--shm-size" in error
        assert fell_back and value == 1.0
        assert left == []


def attach_fails(world, run) -> list:
    from ddpkit.comm import shm

    real = shm.segment.attach

    def broken(name, size):
        raise OSError("simulated: no such segment")

    shm.segment.attach = broken
    try:
        shm.ShmCommunicator(run=run)
        error = ""
    except CommError as exc:
        error = str(exc)
    finally:
        shm.segment.attach = real
    dist.barrier()  # the leader unlinks as it raises: let it get there
    return [error, _segments(run)]


def test_failed_attach_raises_on_every_rank_and_leaves_nothing(pools):
    run = f"t{uuid.uuid4().hex[:8]}"
    for error, left in pools(2).run(attach_fails, run):
        assert "could not attach" in error
        assert left == []


_CREATE_AND_HANG = """
import sys, time
from ddpkit.comm.shm import segment as s
seg = s.create(s.new_name(sys.argv[1], "ctl"), 1 << 20)
print(seg.name, flush=True)
time.sleep(600)
"""


def restart_cleans(world, run) -> list:
    from ddpkit.comm.shm import ShmCommunicator

    with ShmCommunicator(run=run):
        return _segments(run)


def test_segment_of_a_killed_rank_is_removed_at_restart(pools):
    run = f"t{uuid.uuid4().hex[:8]}"
    # A leader killed between creating a segment and its peers attaching leaves a file.
    child = subprocess.Popen([sys.executable, "-c", _CREATE_AND_HANG, run],
                             stdout=subprocess.PIPE, text=True)
    killed_name = child.stdout.readline().strip()
    # A live process's segment of the same run must survive the cleanup.
    live = shm_segment.create(shm_segment.new_name(run, "ctl"), 4096)
    try:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        assert killed_name in _segments(run)
        remaining = pools(2).run(restart_cleans, run)
        assert killed_name not in os.listdir(shm_segment.SHM_DIR)
        assert remaining[0] == [live.name] == remaining[1]
    finally:
        live.close()
    assert _segments(run) == []


def test_waiting_for_a_dead_or_stuck_peer_raises():
    from ddpkit.comm.shm.sync import Control, block_bytes

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    buffer = bytearray(block_bytes(2))
    ctl = Control(buffer, 2, 0, timeout=60, labels=["rank 0", "rank 1"])
    ctl.words[1 * 16 + 1] = dead.pid  # the peer's pid word
    start = time.monotonic()
    with pytest.raises(CommError, match="rank 1 .* exited"):
        ctl.barrier()
    assert time.monotonic() - start < 10
    ctl = Control(buffer, 2, 0, timeout=0.3, labels=["rank 0", "rank 1"])
    ctl.words[1 * 16 + 1] = os.getpid()  # alive, but never arrives
    with pytest.raises(CommError, match="did not reach"):
        ctl.barrier()


# ---------------------------------------------------------------- integration


def through_ddpkit_comm(world) -> list:
    import ddpkit.comm as comm
    from ddpkit.comm import registry

    x = torch.arange(10_000, dtype=torch.float32) * (world.rank + 1)
    expected = x.clone()
    dist.all_reduce(expected)
    via_shm = x.clone()
    comm.all_reduce(via_shm, algo="shm")
    via_auto = x.clone()
    comm.all_reduce(via_auto, op="avg", algo="auto")
    picked = registry.resolve_algo("auto", x, None)[0]
    handle = comm.all_reduce(x, algo="shm", async_op=True)  # runs on a companion group
    handle.wait()
    return [torch.equal(via_shm, expected), torch.equal(via_auto, expected / world.world_size),
            picked, "shm" in comm.algorithms(), torch.equal(x, expected)]


def test_registered_as_algorithm_and_first_choice_of_auto(pools):
    for same, avg_same, picked, listed, async_same in pools(2).run(through_ddpkit_comm):
        assert same and avg_same and listed and async_same
        assert picked == "shm"


def ddpkit_engine_training(world, steps) -> dict:
    """ddpkit.DataParallel with buckets allocated in shared memory and the shm hook,
    against the same engine with its default all-reduce."""
    import ddpkit
    from ddpkit.comm.shm.hook import ShmState, shm_hook

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))

    state = ShmState(slot_mb=SLOT_MB)
    reference = ddpkit.DataParallel(make(), bucket_cap_mb=0.01)
    ours = ddpkit.DataParallel(make(), bucket_cap_mb=0.01, comm_hook=shm_hook, comm_state=state)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, ours)]
    g = torch.Generator().manual_seed(world.rank)
    grads_in_shm = []
    for _ in range(steps):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 3, (16,), generator=g)
        for model, opt in zip((reference, ours), opts):
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        grads_in_shm.append(all(state.communicator._find(p.grad.view(-1)) is not None
                                for p in ours.parameters()))
    diff = max((a - b).abs().max().item()
               for a, b in zip(reference.parameters(), ours.parameters()))
    flat = torch.cat([p.detach().flatten() for p in ours.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, dist.ReduceOp.MAX)
    state.close()
    return {"diff": diff, "spread": (spread - flat).abs().max().item(), "in_shm": grads_in_shm}


def test_dataparallel_with_shared_buckets_trains_like_the_default_engine(pools):
    for result in pools(2).run(ddpkit_engine_training, 4):
        assert result["diff"] < 1e-5
        assert result["spread"] == 0.0
        assert result["in_shm"][-1]  # gradients land in shared memory, no copy in


def uneven_inputs_with_join(world) -> dict:
    """ddpkit.join: ranks with fewer batches mirror the collectives of the others; the
    shm hook must divide as the engine says (bucket.divisor()) to match the default."""
    import ddpkit
    from ddpkit.comm.shm.hook import ShmState, shm_hook

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    state = ShmState()
    results = []
    for options in ({}, {"comm_hook": shm_hook, "comm_state": state}):
        model = ddpkit.DataParallel(make(), bucket_cap_mb=0.001, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(world.rank)
        with ddpkit.join(model, divide_by_initial_world_size=False):
            for _ in range(2 + 2 * world.rank):  # rank 1 trains twice as many batches
                x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    state.close()
    return {"diff": (results[0] - results[1]).abs().max().item()}


def test_join_with_uneven_inputs_matches_the_default_engine(pools):
    for result in pools(2).run(uneven_inputs_with_join):
        assert result["diff"] < 1e-6


def test_a_segment_is_readable_by_its_owner_only_whatever_the_umask():
    old = os.umask(0)  # the most permissive a user can have
    try:
        seg = shm_segment.create(shm_segment.new_name(uuid.uuid4().hex[:8], "mode"), 4096)
    finally:
        os.umask(old)
    try:
        assert os.stat(seg.path).st_mode & 0o777 == 0o600
        assert os.stat(seg.path).st_uid == os.getuid()
    finally:
        seg.close()
    assert not os.path.exists(seg.path)
