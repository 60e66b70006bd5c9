"""`ddpkit verify` passes on a correct setup and catches a broken gradient average, down
to one sample missing from one step's gradient and a divisor that counts padding."""

import dataclasses
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
    from ddpkit.train.equivalence import verify

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


# 299 training samples in global batches of 32: step 10 has 11 real samples, 6 + 5 on two
# ranks, and rank 1's shard is padded to 6. Twelve steps cross it and the epoch's end.
PADDED = resolve({"data": "synthetic", "synthetic_size": 299, "batch_size": 32,
                  "threads": 1}).to_dict()
PADDED_STEPS = 12


def _drop_one_sample(batch, world):
    """Rank 1 leaves its last real sample out of the first step's loss (an off-by-one)."""
    if world.rank == 1 and batch.epoch == 0 and batch.step == 0:
        return dataclasses.replace(batch, num_real=batch.num_real - 1)
    return batch


def _divide_by_padded_size(batch, world):
    """The loss of a padded batch is divided by its padded size, not its real samples."""
    padded = len(batch.indices) * world.world_size
    if batch.global_num_real < padded:
        return dataclasses.replace(batch, global_num_real=padded)
    return batch


BUGS = {"drop_one_sample": _drop_one_sample, "divide_by_padded_size": _divide_by_padded_size}


def _verify_with_bug(world, cfg_dict, steps, dtype, bug):
    """verify() with the W-rank side's batches altered the way ``bug`` says; the trainer
    weights each rank's loss by num_real and global_num_real, so this is exactly a trainer
    that miscounts. Returns (rank 0's result, how many batches the bug changed here)."""
    from ddpkit.data.partition import ShardSampler

    real_batches = ShardSampler.batches
    changed = []

    def batches(sampler, *args, **kwargs):
        for batch in real_batches(sampler, *args, **kwargs):
            # The single-process reference (one replica) must stay correct.
            altered = BUGS[bug](batch, world) if sampler.num_replicas > 1 else batch
            changed.extend([altered] if altered != batch else [])
            yield altered

    ShardSampler.batches = batches
    try:
        return _verify(world, cfg_dict, steps, dtype, None), len(changed)
    finally:
        ShardSampler.batches = real_batches


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_verify_drift_is_far_below_its_tolerance(pools, dtype):
    """Measured: the W-rank result is within ~1 eps of one process after 12 steps (3.0e-8
    against a float32 tolerance of 9.2e-5; 8.3e-17 against 1.7e-13 in float64)."""
    result = pools(2).run(_verify, PADDED, PADDED_STEPS, dtype, None)[0]
    assert result["passed"], result
    assert result["max_abs_diff"] < result["tolerance"] / 100


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_verify_catches_a_subtle_miscount(pools, bug, dtype):
    """Measured in float32: one sample of 384 missing once is 300x the tolerance, the
    padded divisor (11 vs 12, one step) 45x; in float64 both are ~1e10x."""
    results = pools(2).run(_verify_with_bug, PADDED, PADDED_STEPS, dtype, bug)
    assert [changed for _, changed in results] == ([0, 1] if bug == "drop_one_sample" else [1, 1])
    result = results[0][0]
    assert not result["passed"], result
    assert result["max_abs_diff"] > 10 * result["tolerance"]


def test_verify_tolerance_scales_with_dtype():
    from ddpkit.train.equivalence import tolerance

    assert tolerance(torch.float64, 10, 0.5) < 1e-8 * tolerance(torch.float32, 10, 0.5)
    assert tolerance(torch.float32, 10, 4.0) == pytest.approx(4 * tolerance(torch.float32, 10, 1.0))


@pytest.mark.slow
@pytest.mark.e2e
def test_ddpkit_verify_cli():
    # --comm shm: the flag reaches the launched workers (it was a launch of its own in
    # tests/test_ddp_comm.py); auto, the default, picks shm here too, and the default
    # command line is docs/training.md's `ddpkit verify --steps 5` (tests/test_docs.py).
    proc = subprocess.run([sys.executable, "-m", "ddpkit.cli", "verify", "--nproc-per-node", "2",
                           "--steps", "3", "--comm", "shm"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks vs 1 process, 3 steps" in proc.stdout and proc.stdout.rstrip().endswith("PASS")
