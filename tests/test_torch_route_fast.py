"""The remembered paths of a repeated small all_reduce (ddpkit/comm/torch_route.py's
direct route, ddpkit/comm/shm/direct.py): the same bits as torch's gloo, for every op
and dtype the route covers, and forgotten when what they were judged on changes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit import comm
from ddpkit.comm import collectives, registry, torch_route
from ddpkit.comm.shm import algorithm as shm_algorithm
from dist_pool import DistPool

ROUTED_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
          torch.uint8, torch.int32, torch.int64)
# contiguous shapes: 1 KiB of float32, 2-D, 0-dim, empty, and one above the small size
SHAPES = ((256,), (4, 8), (), (0,), (20000,))


def _values(shape, dtype, rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, shape, generator=gen, dtype=dtype)


class _FullPathCounter:
    """Counts the calls that reach ddpkit.comm's full all_reduce from the route."""

    def __init__(self):
        self.calls = 0
        self._real = collectives.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._real(*args, **kwargs)


def run_routed_against_gloo(world) -> dict:
    gloo = torch_route.original("all_reduce")
    counter = _FullPathCounter()
    torch_route.route()
    collectives.all_reduce = counter
    mismatches, calls, seed = [], 0, 0
    try:
        for dtype in DTYPES:
            for op in ROUTED_OPS:
                for shape in SHAPES:
                    seed += 1
                    x = _values(shape, dtype, world.rank, seed)
                    want = x.clone()
                    gloo(want, op)
                    for repeat in range(3):  # the first judged in full, then remembered
                        got = x.clone()
                        dist.all_reduce(got, op)
                        calls += 1
                        if got.shape != want.shape or not torch.equal(got, want):
                            mismatches.append(f"{dtype} {op} {shape} call {repeat}")
                # a negative view (its bytes are not its values): same bits as gloo's
                x = torch._neg_view(_values((6,), dtype, world.rank, seed))
                want = x.clone()  # the values, as a plain tensor
                gloo(want, op)
                dist.all_reduce(x, op)
                calls += 1
                if not torch.equal(x, want):
                    mismatches.append(f"{dtype} {op} negative view")
                # a non-contiguous tensor of the same call: judged in full every time
                x = _values((8, 6), dtype, world.rank, seed).t()
                want = x.clone()
                gloo(want, op)
                dist.all_reduce(x, op)
                calls += 1
                if not torch.equal(x, want):
                    mismatches.append(f"{dtype} {op} transposed")
    finally:
        collectives.all_reduce = counter._real
        torch_route.restore()
    return {"mismatches": mismatches, "full_path": counter.calls, "calls": calls,
            "answered": torch_route.counts().get("all_reduce", 0)}


def test_routed_all_reduce_gives_gloos_bits_and_repeats_skip_the_full_path(pools):
    for out in pools(2).run(run_routed_against_gloo):
        assert out["mismatches"] == [], out
        # per (dtype, op): one judged in full, then remembered; each transposed call in full
        assert out["full_path"] == 2 * len(DTYPES) * len(ROUTED_OPS), out
        assert out["answered"] >= out["calls"], out


def run_reused_tensors_against_gloo(world) -> list[str]:
    """One tensor all-reduced again and again with new values, and new tensors where
    the allocator puts freed ones: the direct path copies from addresses it met before
    through views it made then (comm/shm/direct.py), which must read the values of now."""
    gloo = torch_route.original("all_reduce")
    torch_route.route()
    mismatches = []
    try:
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            for shape in ((256,), (3, 5), ()):
                reused = torch.empty(shape, dtype=dtype)
                for step in range(8):
                    x = _values(shape, dtype, world.rank, 1000 + step)
                    want = x.clone()
                    gloo(want)
                    reused.copy_(x)
                    dist.all_reduce(reused)
                    fresh = x.clone()  # often where the last step's clone was
                    dist.all_reduce(fresh)
                    for name, got in (("reused", reused), ("fresh", fresh)):
                        if not torch.equal(got, want):
                            mismatches.append(f"{dtype} {shape} step {step} {name}")
    finally:
        torch_route.restore()
    return mismatches


def test_a_tensor_reused_or_a_freed_address_gives_the_values_of_now(pools):
    for mismatches in pools(2).run(run_reused_tensors_against_gloo):
        assert mismatches == []


PUBLIC_OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT,
              "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
              "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
              "bxor": dist.ReduceOp.BXOR, "avg": None}


def run_public_against_gloo(world) -> list[str]:
    """ddpkit.comm.all_reduce's remembered path (the shm direct one) against gloo."""
    mismatches, seed = [], 100
    for dtype in DTYPES:
        for name, op in PUBLIC_OPS.items():
            if (name in ("band", "bor", "bxor")) == dtype.is_floating_point:
                continue
            if name == "avg" and not dtype.is_floating_point:
                continue
            for shape in SHAPES:
                seed += 1
                x = _values(shape, dtype, world.rank, seed)
                want = x.clone()
                dist.all_reduce(want, op or dist.ReduceOp.SUM)
                if name == "avg":
                    want.div_(world.world_size)
                for repeat in range(3):
                    got = x.clone()
                    comm.all_reduce(got, name)
                    if not torch.equal(got, want):
                        mismatches.append(f"{dtype} {name} {shape} call {repeat}")
    return mismatches


def test_ddpkit_comm_remembered_all_reduce_gives_gloos_bits(pools):
    for mismatches in pools(2).run(run_public_against_gloo):
        assert mismatches == []


def run_route_forgotten(world, store_dir: str) -> dict:
    """A remembered route serves its own default group, under the algorithm table it was
    found with, and nothing else."""
    counter = _FullPathCounter()
    torch_route.route()
    collectives.all_reduce = counter
    out = {}
    try:
        x = torch.full((16,), float(world.rank + 1))
        for _ in range(3):
            dist.all_reduce(x)
        out["judged_once"] = counter.calls == 1 and x.tolist() == [12.0] * 16

        class Another:
            def all_reduce(self, tensor, op, group=None):
                raise AssertionError("never chosen: auto does not pick it")

        registry.register_algorithm("route-test", Another())
        try:
            dist.all_reduce(x)
            dist.all_reduce(x)
        finally:
            registry.unregister_algorithm("route-test")
        out["table_changed"] = counter.calls == 2  # judged anew once, then remembered

        sub = dist.new_group([0, 1])
        y = torch.ones(4)
        dist.all_reduce(y, group=sub)
        dist.all_reduce(y, group=sub)
        out["subgroup"] = y.tolist() == [4.0] * 4 and counter.calls == 4

        old_world = dist.group.WORLD  # held: its id cannot be reused by the next group
        old_comm = shm_algorithm.group_communicator(None)
        old_calls = old_comm._calls
        dist.destroy_process_group()
        try:
            dist.all_reduce(torch.ones(2))
            out["destroyed"] = "answered"
        except (RuntimeError, ValueError) as err:  # torch's own "not initialized"
            out["destroyed"] = type(err).__name__
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/store2",
                                rank=world.rank, world_size=world.world_size)
        z = torch.full((16,), float(world.rank + 1))
        dist.all_reduce(z)
        dist.all_reduce(z)
        out["new_world"] = (z.tolist() == [6.0] * 16 and counter.calls == 5
                            and old_comm._calls == old_calls
                            and shm_algorithm.group_communicator(None) is not old_comm)
        del old_world
    finally:
        collectives.all_reduce = counter._real
        torch_route.restore()
    return out


def test_a_remembered_route_is_forgotten_when_its_group_or_the_table_changes(tmp_path):
    # its own workers: the test replaces their default group
    pool = DistPool(2)
    try:
        for out in pool.run(run_route_forgotten, str(tmp_path)):
            assert out == {"judged_once": True, "table_changed": True, "subgroup": True,
                           "destroyed": out["destroyed"], "new_world": True}, out
            assert out["destroyed"] in ("ValueError", "RuntimeError"), out
    finally:
        pool.close()
