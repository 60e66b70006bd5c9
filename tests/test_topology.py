import pytest

from ddpkit import ConfigError, Topology
from ddpkit.cli import main


def test_seed_000_mapping():
    topo = Topology(nnodes=2, devices_per_node=4, devices_per_process=2)
    assert topo.world_size == 4 and topo.local_world_size == 2
    table = [(p.node, p.local_rank, p.rank, p.devices) for p in topo.placements()]
    assert table == [(0, 0, 0, (0, 1)), (0, 1, 1, (2, 3)), (1, 0, 2, (0, 1)), (1, 1, 3, (2, 3))]


def test_one_device_per_process():
    topo = Topology(nnodes=3, devices_per_node=2)
    assert [p.rank for p in topo.placements()] == list(range(6))
    assert {p.devices for p in topo.placements()} == {(0,), (1,)}


@pytest.mark.parametrize("args", [(2, 3, 2), (0, 4, 1), (1, -4, 1), (1, 4, 0)])
def test_invalid_combinations(args):
    with pytest.raises(ConfigError):
        Topology(*args)


def test_cli_prints_table(capsys):
    assert (
        main(["topology", "--nnodes", "2", "--devices-per-node", "4", "--devices-per-process", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "W=4 processes" in out
    assert any(
        line.split()[:3] == ["1", "1", "3"] and "gpu2, gpu3" in line for line in out.splitlines()
    )


def test_cli_error_is_one_line(capsys):
    assert (
        main(["topology", "--nnodes", "1", "--devices-per-node", "3", "--devices-per-process", "2"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not divisible" in err[0]
