"""`ddpkit verify` passes on a correct setup and catches a broken gradient average."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ddpkit.train.config import resolve


def _summing_ddp(module, engine, device):
    """torch DDP whose comm hook sums gradients and forgets to divide by the world size."""
    from torch.nn.parallel import DistributedDataParallel

    def sum_hook(state, bucket):
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp = DistributedDataParallel(module)
    ddp.register_comm_hook(None, sum_hook)
    return ddp


def _averaging_ddp(module, engine, device):
    """The same hook, dividing correctly: custom hooks are fine when they are right."""
    from torch.nn.parallel import DistributedDataParallel

    def avg_hook(state, bucket):
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp = DistributedDataParallel(module)
    ddp.register_comm_hook(None, avg_hook)
    return ddp


def _verify(world, cfg_dict, steps, dtype, wrap):
    from ddpkit.train.config import Config
    from ddpkit.train.verify import verify

    result = verify(Config.from_dict(cfg_dict), world, steps=steps, dtype=dtype, wrap=wrap)
    return None if result is None else result.__dict__


CFG = resolve({"engine": "torch", "threads": 1}).to_dict()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("engine", ["ddpkit", "torch"])
def test_verify_passes_on_a_correct_setup(pools, dtype, engine):
    cfg = resolve({"engine": engine, "threads": 1}).to_dict()
    result = pools(2).run(_verify, cfg, 12, dtype, None)[0]
    assert result["engine"] == engine
    assert result["passed"], result
    assert result["max_rank_diff"] == 0.0
    assert result["max_abs_diff"] <= result["tolerance"]
    assert result["tolerance"] < (1e-3 if dtype == "float32" else 1e-11)
    assert pools(2).run(_verify, CFG, 12, dtype, _averaging_ddp)[0]["passed"]


def test_verify_catches_a_sum_instead_of_an_average(pools):
    result = pools(2).run(_verify, CFG, 5, "float64", _summing_ddp)[0]
    assert not result["passed"]
    assert result["max_abs_diff"] > 1e6 * result["tolerance"]


def test_verify_tolerance_scales_with_dtype():
    from ddpkit.train.verify import tolerance

    assert tolerance(torch.float64, 10, 0.5) < 1e-8 * tolerance(torch.float32, 10, 0.5)
    assert tolerance(torch.float32, 10, 4.0) == pytest.approx(4 * tolerance(torch.float32, 10, 1.0))


@pytest.mark.slow
def test_ddpkit_verify_cli():
    proc = subprocess.run([sys.executable, "-m", "ddpkit.cli", "verify", "--nproc-per-node", "2",
                           "--steps", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks vs 1 process, 3 steps" in proc.stdout and proc.stdout.rstrip().endswith("PASS")
