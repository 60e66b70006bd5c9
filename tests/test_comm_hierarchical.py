"""The shm engine across (faked) hosts: every collective hierarchical, results equal to
torch's (gloo), identical bytes on every rank where every rank gets the same result, and
no silent fallback to the backend where the layout allows the hierarchical path.

Hosts are faked on one machine by giving each rank a host id (``host_id=`` to
ShmCommunicator, ``$DDPKIT_HOST_ID`` for the public door). Layouts, by rank:

* ``blocks``: W=4 as 2 hosts x 2 consecutive ranks (torchrun's layout): all hierarchical;
* ``uneven``: W=3 as hosts of 2 and 1 ranks: all_gather / reduce_scatter take the backend;
* ``interleaved``: W=4, ranks 0,2 on one host and 1,3 on the other: the same;
* ``singles``: W=3, one rank per host (the communicator only: "auto" takes the backend
  there): three leaders, and a middle host with blocks on both sides of its own.
"""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest
import torch
import torch.distributed as dist

from ddpkit.errors import CommError

LAYOUTS = {
    "blocks": (4, (0, 0, 1, 1)),
    "uneven": (3, (0, 0, 1)),
    "interleaved": (4, (0, 1, 0, 1)),
    "singles": (3, (0, 1, 2)),
}
PUBLIC_LAYOUTS = ("blocks", "interleaved", "uneven")
SLOT_MB = 0.02  # tiny slots: 3072 float32 a piece, so the larger sizes cross many pieces
SIZES = (1, 7, 1001, 5003)  # odd sizes, fewer elements than ranks, several pieces
CASES = (("sum", torch.float32), ("sum", torch.int64), ("max", torch.float64),
         ("max", torch.int32), ("avg", torch.float32))
GATHER_DTYPES = (torch.float32, torch.int64)


def _input(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _same(got: torch.Tensor, want: torch.Tensor, op: str) -> bool:
    """Exact for max and integers; a float sum may add in another order than gloo's."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if op == "max" or not got.dtype.is_floating_point:
        return torch.equal(got, want)
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5)


def _torch_reduce(x: torch.Tensor, op: str, dst: int | None = None) -> torch.Tensor:
    """gloo's answer (``dst`` None: all_reduce); avg is gloo's sum divided by W."""
    want = x.clone()
    red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    if dst is None:
        dist.all_reduce(want, red)
    else:
        dist.reduce(want, dst, red)
    if op == "avg":
        want = want / dist.get_world_size()
    return want


def _torch_gather(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


# ---------------------------------------------------------------- the communicator itself


def communicator_grid(world, layout: str, run: str) -> dict:
    """Every collective of a ShmCommunicator on faked hosts against gloo: every root,
    op, dtype and size. Returns failures (empty when all match) and per-check digests
    of results every rank must hold bit for bit."""
    from ddpkit.comm.shm import ShmCommunicator

    p, r = world.world_size, world.rank
    hosts = LAYOUTS[layout][1]
    failures: list[str] = []
    digests: dict[str, str] = {}
    seed = 0
    with ShmCommunicator(host_id=f"fake-host-{hosts[r]}", slot_mb=SLOT_MB, run=run,
                         timeout=60) as comm:
        out = {"nhosts": comm.nhosts, "blocks": comm.host_blocks}
        for op, dtype in CASES:
            for numel in SIZES:
                seed += 1
                x = _input(r, numel, dtype, seed)
                got = x.clone()
                comm.all_reduce(got, op)
                if not _same(got, _torch_reduce(x, op), op):
                    failures.append(f"all_reduce {op} {dtype} {numel}")
                digests[f"all_reduce {op} {dtype} {numel}"] = _digest(got)
                for dst in range(p):
                    got = x.clone()
                    comm.reduce(got, dst, op)
                    want = _torch_reduce(x, op, dst)
                    if r == dst and not _same(got, want, op):
                        failures.append(f"reduce {op} {dtype} {numel} dst={dst}")
                    if r != dst and not torch.equal(got, x):
                        failures.append(f"reduce {op} {dtype} {numel} dst={dst}: non-dst changed")
                big = _input(r, numel * p, dtype, seed)
                shard = torch.empty(numel, dtype=dtype)
                try:
                    comm.reduce_scatter(shard, big, op)
                    want = _torch_reduce(big, op)[r * numel:(r + 1) * numel]
                    if not _same(shard, want, op):
                        failures.append(f"reduce_scatter {op} {dtype} {numel}")
                    if not torch.equal(big, _input(r, numel * p, dtype, seed)):
                        failures.append(f"reduce_scatter {op} {dtype} {numel}: input changed")
                    out.setdefault("reduce_scatter", "ran")
                except CommError as err:
                    out["reduce_scatter"] = str(err)
        for dtype in GATHER_DTYPES:
            for numel in SIZES:
                seed += 1
                x = _input(r, numel, dtype, seed)
                for src in range(p):
                    got = x.clone()
                    comm.broadcast(got, src)
                    want = x.clone()
                    dist.broadcast(want, src)
                    if not torch.equal(got, want):
                        failures.append(f"broadcast {dtype} {numel} src={src}")
                    digests[f"broadcast {dtype} {numel} src={src}"] = _digest(got)
                gathered = torch.empty(numel * p, dtype=dtype)
                try:
                    comm.all_gather(gathered, x)
                    if not torch.equal(gathered, _torch_gather(x)):
                        failures.append(f"all_gather {dtype} {numel}")
                    digests[f"all_gather {dtype} {numel}"] = _digest(gathered)
                    out.setdefault("all_gather", "ran")
                except CommError as err:
                    out["all_gather"] = str(err)
        comm.barrier()
    out["failures"] = failures
    out["digests"] = digests
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_collective_matches_torch_on_fake_hosts(pools, layout):
    world_size, hosts = LAYOUTS[layout]
    results = pools(world_size).run(communicator_grid, layout, f"t{uuid.uuid4().hex[:8]}",
                                    timeout=300)
    blocks = layout in ("blocks", "singles")
    for rank, result in enumerate(results):
        assert result["nhosts"] == len(set(hosts)), rank
        assert result["blocks"] is blocks, rank
        assert result["failures"] == [], (rank, result["failures"])
        for collective in ("all_gather", "reduce_scatter"):
            if blocks:
                assert result[collective] == "ran", (rank, result[collective])
            else:  # every rank refuses alike, naming the layout and the way out
                assert "consecutive group ranks" in result[collective], result[collective]
                assert "algo='backend'" in result[collective]
    # results every rank receives whole are the same bytes everywhere
    first = results[0]["digests"]
    kinds = ("all_reduce", "broadcast") + (("all_gather",) if blocks else ())
    assert {k.split()[0] for k in first} == set(kinds)
    for rank, result in enumerate(results[1:], 1):
        assert result["digests"] == first, rank


# ---------------------------------------------------------------- the public door


class _Spy:
    """Stands in for a BackendAlgorithm: records (collective, group size) and delegates."""

    def __init__(self, real, calls: list):
        self._real, self._calls = real, calls

    def __getattr__(self, name):
        fn = getattr(self._real, name)

        def call(*args, **kwargs):
            group = kwargs.get("group", args[-1] if args else None)
            self._calls.append((name, dist.get_world_size(group)))
            return fn(*args, **kwargs)
        return call


def public_with_spies(world, layout: str) -> dict:
    """ddpkit.comm with no algo argument on a fresh group whose ranks claim the layout's
    hosts, with the backend fallback and the leaders' backend calls watched."""
    from ddpkit import comm as dcomm
    from ddpkit.comm import auto, registry
    from ddpkit.comm.shm import algorithm, hierarchical

    p, r = world.world_size, world.rank
    hosts = LAYOUTS[layout][1]
    before = os.environ.get("DDPKIT_HOST_ID")
    os.environ["DDPKIT_HOST_ID"] = f"fake-host-{hosts[r]}"
    group = dist.new_group(list(range(p)))  # fresh group: fresh decision and communicator
    impl = registry.get_algorithm("hierarchical")
    fallback, leaders = [], []
    real_fallback, real_leaders = impl._backend, hierarchical._leaders
    out: dict = {"ok": [], "digests": []}
    try:
        out["algo"] = auto.algo_for(group, "cpu")
        dcomm.barrier(group=group)  # sets up the communicator before anything is watched
        impl._backend = _Spy(real_fallback, fallback)
        hierarchical._leaders = _Spy(real_leaders, leaders)
        marks = []

        def mark(name):
            marks.append((name, len(fallback), len(leaders)))

        for op, dtype in (("sum", torch.float64), ("avg", torch.float32), ("max", torch.int64)):
            x = _input(r, 1001, dtype, 1)
            got = x.clone()
            dcomm.all_reduce(got, op, group=group)
            out["ok"].append(_same(got, _torch_reduce(x, op), op))
            out["digests"].append(_digest(got))
            mark("all_reduce")
            for dst in range(p):
                got = x.clone()
                dcomm.reduce(got, dst, op, group=group)
                want = _torch_reduce(x, op, dst)
                out["ok"].append(_same(got, want, op) if r == dst else torch.equal(got, x))
                mark("reduce")
            shard = torch.empty(13, dtype=dtype)
            big = _input(r, 13 * p, dtype, 2)
            dcomm.reduce_scatter(shard, big, op, group=group)
            out["ok"].append(_same(shard, _torch_reduce(big, op)[13 * r:13 * (r + 1)], op))
            mark("reduce_scatter")
        for src in range(p):
            y = _input(r, 777, torch.float32, 3)
            dcomm.broadcast(y, src, group=group)
            want = _input(r, 777, torch.float32, 3)
            dist.broadcast(want, src)
            out["ok"].append(torch.equal(y, want))
            out["digests"].append(_digest(y))
            mark("broadcast")
        x = _input(r, 9, torch.int32, 4)
        gathered = torch.empty(9 * p, dtype=torch.int32)
        dcomm.all_gather(gathered, x, group=group)
        out["ok"].append(torch.equal(gathered, _torch_gather(x)))
        out["digests"].append(_digest(gathered))
        mark("all_gather")
        dcomm.barrier(group=group)
        mark("barrier")
        out["marks"] = marks
        out["fallback"] = fallback
        out["leaders"] = leaders
        return out
    finally:
        impl._backend, hierarchical._leaders = real_fallback, real_leaders
        found = algorithm._communicators.pop(group, None)
        if found is not None:
            found.close()
        if before is None:
            del os.environ["DDPKIT_HOST_ID"]
        else:
            os.environ["DDPKIT_HOST_ID"] = before


def _per_collective(marks: list, index: int) -> dict:
    """How many calls (fallback: index 1, leaders: index 2) each collective made."""
    counts: dict[str, int] = {}
    previous = 0
    for mark in marks:
        counts[mark[0]] = counts.get(mark[0], 0) + mark[index] - previous
        previous = mark[index]
    return counts


@pytest.mark.parametrize("layout", PUBLIC_LAYOUTS)
def test_public_door_is_hierarchical_not_a_silent_backend_fallback(pools, layout):
    world_size, hosts = LAYOUTS[layout]
    results = pools(world_size).run(public_with_spies, layout, timeout=300)
    blocks = layout == "blocks"
    leader_ranks = {hosts.index(h) for h in set(hosts)}
    for rank, result in enumerate(results):
        assert result["algo"] == "hierarchical", rank
        assert result["ok"] and all(result["ok"]), (rank, result["ok"])
        fallback = _per_collective(result["marks"], 1)
        leaders = _per_collective(result["marks"], 2)
        # the backend fallback only where the layout rules the hierarchical path out
        expected_fallback = {"all_reduce": 0, "reduce": 0, "broadcast": 0, "barrier": 0,
                             "reduce_scatter": 0 if blocks else 3,
                             "all_gather": 0 if blocks else 1}
        assert fallback == expected_fallback, (rank, result["fallback"])
        assert all(size == world_size for _, size in result["fallback"]), rank
        # one backend call per collective between the two leaders, none elsewhere
        calls = 1 if rank in leader_ranks else 0
        expected_leaders = {"all_reduce": 3 * calls, "reduce": 3 * world_size * calls,
                            "broadcast": world_size * calls, "barrier": calls,
                            "reduce_scatter": 3 * calls if blocks else 0,
                            "all_gather": calls if blocks else 0}
        assert leaders == expected_leaders, (rank, result["leaders"])
        assert all(size == 2 for _, size in result["leaders"]), rank
        names = [name for name, _ in result["leaders"]]
        assert set(names) <= {"all_reduce", "reduce", "broadcast", "barrier",
                              "reduce_scatter", "all_gather"}
    for rank, result in enumerate(results[1:], 1):
        assert result["digests"] == results[0]["digests"], rank


def communicator_after_uneven_groups(world, run: str) -> list[float]:
    """Rank 0 holds a group its peers do not (made by its members alone, as a user may);
    then a communicator spanning fake hosts is built and used."""
    from ddpkit.comm.shm import ShmCommunicator

    extra = dist.new_group([0], use_local_synchronization=True) if world.rank == 0 else None
    try:
        with ShmCommunicator(host_id=f"fake-host-{world.rank}", run=run, timeout=30) as comm:
            x = torch.full((3,), float(world.rank + 1))
            comm.all_reduce(x)
            return x.tolist()
    finally:
        if extra is not None:
            dist.destroy_process_group(extra)


def test_leaders_group_is_made_when_ranks_hold_different_groups(pools):
    # The leaders' group used to be made by the leaders alone, and torch names such a
    # group from how many groups each member holds: here the ranks disagreed and waited
    # for each other forever (seen as a 300 s pool timeout in CI).
    results = pools(3).run(communicator_after_uneven_groups, f"t{uuid.uuid4().hex[:8]}",
                           timeout=90)
    assert results == [[6.0, 6.0, 6.0]] * 3
