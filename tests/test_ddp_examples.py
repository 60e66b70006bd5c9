"""The DDP tutorial's programs (basic on ddpkit's engine, checkpoint, model parallel).

The basic demo is launched as a user runs it (one end-to-end ``ddpkit launch`` of a
tutorial program); the checkpoint and model-parallel demos run their ``demo_*`` function
on the session's pooled gloo ranks, where a launch would add only process start-up.
"""

import contextlib
import io
import re

import pytest
import torch

from test_examples import _load
from test_launch import run_cli


def test_basic_demo_on_ddpkit_engine_keeps_replicas_identical():
    proc = run_cli("launch", "--nproc-per-node", "2", "examples/20_ddpkit_engine.py", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "identical: True" in proc.stdout
    for rank in (0, 1):
        assert f"Finished running basic DDP example on rank {rank}." in proc.stdout


def _run_demo(world, name):
    """Run the example's demo on this pool rank, as its main() does after init; return
    what it printed."""
    example = _load(name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if name == "03_ddp_checkpoint":
            example.demo_checkpoint(world.rank, torch.device("cpu"))
        else:
            example.demo_model_parallel(world.rank, *example.devices_for(world.local_rank))
    return out.getvalue()


# slow: the first torch DDP in a pool rank imports what DDP needs (seconds).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["03_ddp_checkpoint", "04_ddp_model_parallel"])
def test_checkpoint_and_model_parallel_demos(pools, name):
    outs = pools(2).run(_run_demo, name)
    sums = [re.findall(r"Finished .* on rank (\d): parameter checksum (\S+)", out) for out in outs]
    assert [s[0][0] for s in sums if len(s) == 1] == ["0", "1"], outs
    assert sums[0][0][1] == sums[1][0][1], outs
