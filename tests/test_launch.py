"""`ddpkit launch` end to end: real torchrun agent, examples' output lines, failures."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from ddpkit import ConfigError
from ddpkit.launch import LaunchOptions, torchrun_argv

DDPKIT = [sys.executable, "-m", "ddpkit.cli"]


def run_cli(*args, timeout=120):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [*DDPKIT, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_spmd_example_under_launch():
    proc = run_cli("launch", "--nproc-per-node", "2", "examples/01_spmd_main.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(
            rf"\[default{rank}\]:\[\d+\] Initializing process group with: "
            rf"\{{'MASTER_ADDR': '[^']+', 'MASTER_PORT': '\d+', 'RANK': '{rank}', "
            rf"'WORLD_SIZE': '2'\}}",
            proc.stdout,
        ), proc.stdout
        assert re.search(rf"\[default{rank}\]:\[\d+\] rank = {rank}, world_size = 2", proc.stdout)
    port = re.search(r"'MASTER_PORT': '(\d+)'", proc.stdout).group(1)
    assert port != "29500"  # standalone picked a free port


FAILING = """
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("boom-on-rank-1")
    dist.barrier()

main()
"""


def test_failing_rank_reported_once(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING)
    proc = run_cli("launch", "--nproc-per-node", "2", str(script))
    assert proc.returncode != 0
    both = proc.stdout + proc.stderr
    assert both.count("ValueError: boom-on-rank-1") == 1, both[-3000:]
    assert "ddpkit launch: rank 1 failed first (exit code 1" in proc.stderr


def test_missing_script_is_one_line():
    proc = run_cli("launch", "--nproc-per-node", "2", "no/such/script.py")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddpkit launch: error: script 'no/such/script.py' does not exist; "
        "give the path of a Python file"
    ]


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_invalid_nproc(bad):
    proc = run_cli("launch", "--nproc-per-node", bad, "examples/01_spmd_main.py")
    assert proc.returncode == 2 and "--nproc-per-node must be a positive integer" in proc.stderr


def test_multinode_argv_marks_local_endpoint_as_host():
    argv = torchrun_argv(LaunchOptions(nnodes="2", rdzv_endpoint="127.0.0.1:29411"), 1)
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert "is_host=1" in argv and argv[argv.index("--local-addr") + 1] == "127.0.0.1"
    remote = torchrun_argv(LaunchOptions(nnodes="2", rdzv_endpoint="203.0.113.9:29411"), 1)
    assert "is_host=1" not in remote  # a remote endpoint: this node is a client
    with pytest.raises(ConfigError, match="needs --rdzv-endpoint"):
        torchrun_argv(LaunchOptions(nnodes="2"), 1)
    with pytest.raises(ConfigError, match="not HOST:PORT"):
        torchrun_argv(LaunchOptions(nnodes="2", rdzv_endpoint="nohostport"), 1)
