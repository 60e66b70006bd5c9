"""The seed programs in examples/ produce the tutorial's results."""

import contextlib
import importlib.util
import io
import os
import re

import pytest

from conftest import ROOT
from test_launch import run_cli


def _load(name):
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_example(world, name):
    """Run an example's run(rank, size) on this pool rank and return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _load(name).run(world.rank, world.world_size)
    return out.getvalue()


@pytest.mark.parametrize("name", ["05_p2p_blocking", "06_p2p_nonblocking", "07_allreduce_group"])
def test_point_to_point_and_group(pools, name):
    outs = pools(2).run(_run_example, name)
    expected = "2." if name == "07_allreduce_group" else "1."
    for rank, out in enumerate(outs):
        assert f"Rank  {rank}  has data  tensor({expected})" in out


def test_reduce_ops(pools):
    outs = pools(2).run(_run_example, "09_reduce_ops")
    # rank r holds [r+2, -(r+1)] -> sum [5,-3], product [6,2], min [2,-2], max [3,-1]
    for out in outs:
        assert "SUM     float32 -> [5.0, -3.0]" in out
        assert "PRODUCT float32 -> [6.0, 2.0]" in out
        assert "MIN     float32 -> [2.0, -2.0]" in out and "MAX     float32 -> [3.0, -1.0]" in out
        # int64 [12|r, 3<<r]: r=0 [12, 3], r=1 [13, 6]
        assert "BAND    int64   -> [12, 2]" in out and "BOR     int64   -> [13, 7]" in out
        assert "BXOR    int64   -> [1, 5]" in out and "AVG     float32 -> [0.5]" in out


def test_every_collective_under_launch_three_ranks():
    proc = run_cli("launch", "--nproc-per-node", "3", "examples/08_collectives.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {
        tuple(re.match(r"\[default(\d)\]:(\w+)\s+rank (\d): (.*)", line).groups())
        for line in proc.stdout.splitlines()
        if re.match(r"\[default\d\]:\w+\s+rank", line)
    }
    for r in range(3):
        assert (str(r), "broadcast", str(r), "[0.0]") in lines
        assert (str(r), "all_reduce", str(r), "[6.0]") in lines
        assert (str(r), "scatter", str(r), f"[{10.0 * r}]") in lines
        assert (str(r), "all_gather", str(r), "[[0.0], [1.0], [2.0]]") in lines
        assert (str(r), "barrier", str(r), "passed") in lines
        want = str([[float(10 * src + r)] for src in range(3)])
        assert (str(r), "all_to_all", str(r), want) in lines
    assert ("0", "reduce", "0", "[6.0]") in lines
    assert ("0", "gather", "0", "[[0.0], [1.0], [2.0]]") in lines


def test_ddp_basic_spawn_keeps_replicas_identical():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "examples/02_ddp_basic_spawn.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"Finished running basic DDP example on rank {rank}." in proc.stdout
    assert "identical: True" in proc.stdout
