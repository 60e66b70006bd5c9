"""The DDP tutorial's programs (basic on ddpkit's engine, checkpoint, model parallel), launched."""

import re

import pytest

from test_launch import run_cli


def _checksums(stdout):
    return {rank: value for rank, value in
            re.findall(r"\[default(\d)\]:Finished .* on rank \d: parameter checksum (\S+)", stdout)}


def test_basic_demo_on_ddpkit_engine_keeps_replicas_identical():
    proc = run_cli("launch", "--nproc-per-node", "2", "examples/20_ddpkit_engine.py", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "identical: True" in proc.stdout
    for rank in (0, 1):
        assert f"Finished running basic DDP example on rank {rank}." in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["03_ddp_checkpoint", "04_ddp_model_parallel"])
def test_checkpoint_and_model_parallel_demos(name):
    proc = run_cli("launch", "--nproc-per-node", "2", f"examples/{name}.py", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = _checksums(proc.stdout)
    assert set(sums) == {"0", "1"} and sums["0"] == sums["1"], proc.stdout[-2000:]
