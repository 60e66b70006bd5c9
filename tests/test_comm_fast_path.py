"""The remembered route of ``comm.all_reduce(t)`` (ddpkit/comm/fast_path.py): taken from the
second call on, still checked in-band, forgotten when the algorithm table changes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit import comm
from ddpkit.comm import collectives, fast_path, registry
from test_comm_errors import _outcome


def run_routes(world):
    r, last = world.rank, world.world_size - 1
    built = []
    original = collectives.Call

    class Counted(original):
        def __init__(self, *args, **kwargs):
            built.append(args[0])
            super().__init__(*args, **kwargs)

    collectives.Call = Counted
    try:
        fast_path.forget()
        results = []
        for step in range(4):  # the first call takes the full path, the rest the route
            x = torch.arange(1000, dtype=torch.float32) * (r + 1) + step
            want = x.clone()
            dist.all_reduce(want)
            comm.all_reduce(x)
            results.append(torch.equal(x, want))
        full_path_calls = len(built)
        # every rank on its route, one with another size: the engine's in-band check
        size = _outcome(lambda: comm.all_reduce(torch.ones(1000 + 3 * (r == last))))
        # one rank refuses locally (full path) while the others are on their routes
        refused = _outcome(lambda: comm.all_reduce(
            torch.ones(8), op="band" if r == last else "sum"))
        after = torch.full((5,), float(r + 1))
        comm.all_reduce(after)
        # a new algorithm table drops the routes: the next call is a full one again
        before = len(built)
        registry.register_algorithm("fast_path_test", registry.get_algorithm("backend"))
        registry.unregister_algorithm("fast_path_test")
        comm.all_reduce(torch.ones(4))
        full_after_change = len(built) - before
    finally:
        collectives.Call = original
    return {"results": results, "full_path_calls": full_path_calls, "size": size,
            "refused": refused, "after": after.tolist(),
            "full_after_change": full_after_change}


def test_route_is_taken_checked_in_band_and_forgotten(pools):
    for world_size, results in ((2, pools(2).run(run_routes)), (3, pools(3).run(run_routes))):
        total = float(sum(range(1, world_size + 1)))
        for res in results:
            assert all(res["results"]), res
            # only the first of the four calls built a full call object
            assert res["full_path_calls"] == 1, res
            assert res["size"].startswith("CommError") and "differ across ranks" in res["size"]
            assert res["refused"].startswith("CommError"), res
            assert res["after"] == [total] * 5
            assert res["full_after_change"] == 1, res
        assert len({res["size"] for res in results}) == 1  # the same message everywhere
