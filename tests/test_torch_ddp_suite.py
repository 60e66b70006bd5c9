"""PyTorch's own DistributedDataParallel tests, with ddpkit.DataParallel substituted.

The tests are torch's (the installed wheel's ``distributed_test`` module, run by
``tests/torch_suite.py``); nothing of them is copied here. DDP_TESTS are the ones that
run on a CPU-only machine with gloo; the census below runs every test of the module
that uses DistributedDataParallel with torch's own class and checks that exactly those
pass (the others skip for want of a GPU), so a torch release that adds a CPU DDP test
makes this file fail until the test is added here.
"""

from __future__ import annotations

import pytest
import torch

import torch_suite

DDP_TESTS = [
    "test_DistributedDataParallelCPU",  # trains, then torch.save/torch.load of the model
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",  # RuntimeError for nothing to train
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_ddp_create_graph",
    "test_ddp_logging_data_cpu",  # _get_ddp_logging_data, _set_ddp_runtime_logging_sample_rate
    "test_grads_same_across_ranks_with_no_sync",  # find_unused_parameters across no_sync
    "test_static_graph_api_cpu",  # _set_static_graph after training: RuntimeError, logged
]
# Tests that pass with torch's class on CPU but not with ddpkit's, with the reason.
EXCLUDED: dict[str, str] = {}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", DDP_TESTS)
def test_torch_ddp_test_passes_with_ddpkit(pools, tmp_path, name, world_size):
    results = pools(world_size).run(torch_suite.run, name, "ddpkit", str(tmp_path))
    torch_suite.check_passed(results, name, "building a ddpkit.DataParallel")


@pytest.mark.parametrize("name", DDP_TESTS)
def test_torch_ddp_test_passes_with_the_class_ddpkit_launch_puts_behind_torchs_name(
        pools, tmp_path, name):
    """The class programs get under ``ddpkit launch`` (ddpkit's engine that is also
    torch's class, torch's private methods left out): torch's tests pass with it too."""
    results = pools(2).run(torch_suite.run, name, "swapped", str(tmp_path))
    torch_suite.check_passed(results, name, "building ddpkit's engine under torch's name")


def test_census_every_cpu_ddp_test_of_torch_is_in_the_suite(pools, tmp_path):
    """torch's class passes exactly DDP_TESTS + EXCLUDED here; the others skip."""
    if torch.cuda.is_available():
        pytest.skip("the census is of the tests that run without a GPU")
    results = pools(2).run(torch_suite.census, (), "DistributedDataParallel", (),
                           str(tmp_path), timeout=300)
    torch_suite.check_census(results, DDP_TESTS, EXCLUDED)
