"""PyTorch's own all_reduce/broadcast/reduce/barrier tests, with ddpkit.comm's functions
behind torch's names, on 3 gloo ranks: plain, full-group, async, complex and timeout
variants (torch's subgroup variants ask for 8 ranks and skip below that, as the census
checks).

The tests are torch's (``tests/torch_suite.py`` runs them, nothing copied). Under
ddpkit's functions, their assertions on gloo's profiler events are off (ddpkit's paths
do not call gloo) and every call is checked against torch's function on a copy of its
input (torch's all_reduce tests assert no values themselves). The census runs every
test of those four collectives with torch's own functions and checks that exactly
COLLECTIVE_TESTS and EXCLUDED run here.
"""

from __future__ import annotations

import pytest
import torch

import torch_suite

WORLD_SIZE = 3
PREFIXES = ("test_all_reduce", "test_broadcast", "test_reduce", "test_barrier",
            "test_all_gather")
_OPS = ("sum", "max", "min", "product")
COLLECTIVE_TESTS = [
    *(f"test_all_reduce_{op}" for op in _OPS),
    *(f"test_all_reduce_full_group_{op}" for op in _OPS),
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_broadcast",
    "test_broadcast_full_group",
    *(f"test_reduce_{op}" for op in _OPS),
    *(f"test_reduce_full_group_{op}" for op in _OPS),
    "test_reduce_sum_twice",
    "test_barrier",
    "test_barrier_full_group",
    "test_barrier_timeout_full_group",  # rank 0 alone in a barrier: the group's timeout
]
_COALESCED = ("dist.all_reduce_coalesced (a list of tensors in one call) is not part of "
              "ddpkit.comm")
# Tests of these collectives that run on CPU with torch's functions but are not run
# with ddpkit's, with the reason.
EXCLUDED = {
    **{f"test_all_reduce_coalesced_{v}": _COALESCED for v in (
        "max", "min", "product", "sum", "full_group_max", "full_group_min",
        "full_group_product", "full_group_sum", "max_complex_unsupported")},
    "test_barrier_timeout_global": (
        "destroys and re-creates the default process group, which the workers share with "
        "every other test"),
}
# torch's all_gather tests: torch's list form is routed to ddpkit.comm.all_gather (one
# output tensor), so these run only with torch's names routed (ddpkit.comm's own
# all_gather takes torch's all_gather_into_tensor arguments, which no CPU test of torch's
# calls). The object tests gather through torch's all_gather.
GATHER_TESTS = ["test_all_gather", "test_all_gather_complex", "test_all_gather_full_group",
                "test_all_gather_object_default_pg", "test_all_gather_object_subgroup"]
_GATHER_COALESCED = ("dist.all_gather_coalesced (a list of tensors in one call) is not part "
                     "of ddpkit.comm")
EXCLUDED.update({f"test_all_gather_coalesced_{v}": _GATHER_COALESCED
                 for v in ("complex", "full_group", "simple", "with_empty")})
# Tests in which only some ranks call a collective (the others wait elsewhere).
ONLY_RANK_0 = {"test_barrier_timeout_full_group": (0,)}
# Not run in the census either (with torch's functions): they break the shared workers.
CENSUS_SKIP = ("test_barrier_timeout_global",)


@pytest.mark.parametrize("name", COLLECTIVE_TESTS)
def test_torch_collective_test_passes_with_ddpkit_comm(pools, tmp_path, name):
    results = pools(WORLD_SIZE).run(torch_suite.run, name, "comm", str(tmp_path))
    torch_suite.check_passed(results, name, "calling ddpkit.comm", ONLY_RANK_0.get(name))


# Tests whose calls the route leaves to torch's own function, with the reason.
NOT_ROUTED = {"test_all_reduce_sum_async": "async_op=True calls stay torch's",
              "test_all_reduce_complex_unsupported_ops": (
                  "an op ddpkit refuses (max on complex) goes to torch, which raises")}


@pytest.mark.parametrize("name", [n for n in COLLECTIVE_TESTS + GATHER_TESTS
                                  if n not in NOT_ROUTED])
def test_torch_collective_test_passes_with_torchs_names_routed_to_ddpkit(pools, tmp_path,
                                                                          name):
    """What ``ddpkit launch`` gives a program: torch.distributed's own functions, which
    hand the calls ddpkit serves to ddpkit.comm (:mod:`ddpkit.comm.torch_route`)."""
    results = pools(WORLD_SIZE).run(torch_suite.run, name, "routed", str(tmp_path))
    torch_suite.check_passed(results, name, "a call answered by ddpkit.comm",
                             ONLY_RANK_0.get(name))


def test_census_every_cpu_collective_test_is_in_the_suite(pools, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the census is of the tests that run without a GPU")
    results = pools(WORLD_SIZE).run(torch_suite.census, PREFIXES, None, CENSUS_SKIP,
                                    str(tmp_path), timeout=300)
    # gloo runs the CENSUS_SKIP tests on CPU (see EXCLUDED for why they are not run)
    torch_suite.check_census(results, COLLECTIVE_TESTS + GATHER_TESTS, EXCLUDED,
                             not_run=CENSUS_SKIP)


def run_and_read_debug_level(world, name: str, temp_dir: str) -> tuple:
    """torch's test ``name`` run as the suite runs it, then this worker's debug level."""
    import os

    import torch.distributed as dist

    outcome = torch_suite.run(world, name, "torch", temp_dir)[0]
    return outcome, os.environ.get("TORCH_DISTRIBUTED_DEBUG"), str(dist.get_debug_level())


def test_a_torch_test_that_sets_the_debug_level_leaves_the_worker_as_it_was(pools, tmp_path):
    """torch's test_broadcast_object_list sets TORCH_DISTRIBUTED_DEBUG=DETAIL and skips,
    leaving it set; the suite puts the level back, or later groups in this shared worker
    come wrapped for debugging and torch's own DDP on them crashes the process (a
    3-rank pool of test_compat_ddp.py died so under two xdist workers)."""
    results = pools(WORLD_SIZE).run(run_and_read_debug_level, "test_broadcast_object_list",
                                     str(tmp_path))
    for outcome, variable, level in results:
        assert outcome == "skip", outcome  # ran (its decorator set the level), then skipped
        assert variable is None and level.endswith("OFF"), (variable, level)
