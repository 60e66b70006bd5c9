"""How tests/data/format1 was made: with ddpkit's code *before* checkpoints became DCP
(format ``ddpkit-checkpoint/1``: ``step_N.pt`` + ``step_N.json``, ZeRO's per-rank files).

    PYTHONPATH=<checkout of that code>/src python tests/data/format1/make.py tests/data/format1

Two tiny runs (``Run`` over a 2-layer MLP, AdamW, 64 samples, global batch 8): ``plain``
at one process, ``zero`` at two with ``shard="optimizer"``. Each saves at step 3 and
goes on to step 5; ``expected.pt`` holds the parameters after step 5 there. Kept by
the tests for good: the checkpoints must go on resuming.

The tests compare with neither ``expected.pt``: they hold float bits of the CPU that made
them (another CPU's kernels round a few last bits differently). A resume is checked
against the checkpoint's own state continued on the machine running the tests, read from
its files by hand (tests/test_checkpoint_dcp.py). ``zero/expected.pt`` is not even the
ZeRO run's step-5 weights: ``run_job`` read ``unwrap(wrapped).state_dict()`` right after
``opt.step()``, before any gather, so it mixes rank 0's step-5 chunks with rank 1's
step-4 ones (that read now raises UsageError).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

import ddpkit
from ddpkit.data import ShardSampler


def build(shard: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    wrapped = ddpkit.DataParallel(model, shard=shard) if shard != "single" else model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    sampler = ShardSampler(data, global_batch_size=8, seed=1)
    return wrapped, opt, sampler, data


def steps(run, wrapped, opt, sampler, data, until: int) -> None:
    for _ in run.epochs(1):
        for batch in run.batches():
            x, y = data.tensors[0][batch.indices], data.tensors[1][batch.indices]
            opt.zero_grad()
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
            run.step_done()
            if run.step == until:
                return


def run_job(world, out: str, shard: str) -> None:
    wrapped, opt, sampler, data = build(shard)
    with ddpkit.Run(Path(out), model=wrapped, optimizer=opt, sampler=sampler) as run:
        steps(run, wrapped, opt, sampler, data, 3)
        run.save("periodic")
        steps(run, wrapped, opt, sampler, data, 5)
        final = {k: v.clone() for k, v in ddpkit.checkpoint.unwrap(wrapped).state_dict().items()}
    if world is None or world.rank == 0:
        torch.save(final, Path(out) / "expected.pt")
        for extra in Path(out).iterdir():  # keep the step-3 checkpoint and the answer only
            if extra.name not in ("checkpoints", "expected.pt"):
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
        for f in (Path(out) / "checkpoints").iterdir():
            if "000000005" in f.name:
                f.unlink()


def main() -> None:
    dest = Path(sys.argv[1])
    run_job(None, str(dest / "plain"), "single")
    ddpkit.spawn(run_job, 2, args=(str(dest / "zero"), "optimizer"))


if __name__ == "__main__":
    main()
