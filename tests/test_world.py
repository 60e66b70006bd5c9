"""World from every launcher's environment, and the errors for inconsistent values."""

import pytest

from ddpkit import ConfigError, World
from ddpkit.runtime.world import assign_devices

CPU = dict(accelerator="cpu", device_count=0)


def test_single_process_default():
    w = World.from_env({}, **CPU)
    assert (w.rank, w.world_size, w.local_rank, w.nnodes, w.source) == (0, 1, 0, 1, "single")
    assert w.devices == ("cpu",) and w.is_main


def test_torchrun_two_nodes():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "29400",
    }
    w = World.from_env(env, accelerator="cuda", device_count=4)
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size, w.node_rank, w.nnodes) == (
        5,
        1,
        8,
        4,
        1,
        2,
    )
    assert w.devices == ("cuda:1",)  # local rank picks the device, not global rank 5
    assert (w.master_addr, w.master_port, w.source) == ("h0", 29400, "torchrun")
    assert not w.is_main


def test_slurm_srun_direct():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    w = World.from_env(env, **CPU)
    assert (w.rank, w.local_rank, w.local_world_size, w.node_rank, w.nnodes) == (3, 1, 2, 1, 2)
    assert w.master_addr == "gpu07" and w.source == "slurm"


def test_slurm_uneven_tasks_is_an_error():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_NNODES": "2", "MASTER_ADDR": "h"}
    with pytest.raises(ConfigError, match="SLURM_NTASKS=3"):
        World.from_env(env, **CPU)


def test_openmpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
    }
    w = World.from_env(env, **CPU)
    assert (w.rank, w.local_rank, w.node_rank, w.nnodes, w.source) == (3, 1, 1, 2, "openmpi")


def test_pmi():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "x"}
    w = World.from_env(env, **CPU)
    assert (w.rank, w.world_size, w.source) == (1, 2, "pmi")


def test_torchrun_wins_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "1", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"}
    assert World.from_env(env, **CPU).source == "torchrun"


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "rank 2 is outside"),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "h"},
            "does not divide",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size must be >= 1"),
        (
            {
                "RANK": "0",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
            },
            "local rank 2 is outside",
        ),
    ],
)
def test_inconsistent_env_names_the_value(env, needle):
    with pytest.raises(ConfigError, match=needle):
        World.from_env(env, **CPU)


def test_file_rendezvous_needs_no_master_addr():
    w = World.from_env({"RANK": "1", "WORLD_SIZE": "2"}, require_master_addr=False, **CPU)
    assert w.rank == 1


def test_too_few_gpus_is_one_clear_error():
    env = {
        "RANK": "0",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "h",
    }
    with pytest.raises(ConfigError, match="requires at least 8 CUDA devices, found 4"):
        World.from_env(env, accelerator="cuda", device_count=4)


def test_process_spanning_two_devices_uses_local_rank():
    assert assign_devices(
        local_rank=1, local_world_size=2, devices_per_process=2, accelerator="cuda", device_count=4
    ) == ("cuda:2", "cuda:3")
    with pytest.raises(ConfigError):
        assign_devices(
            local_rank=0,
            local_world_size=1,
            devices_per_process=0,
            accelerator="cpu",
            device_count=0,
        )


def test_world_is_frozen():
    w = World.from_env({}, **CPU)
    with pytest.raises(AttributeError):
        w.rank = 3
