"""Multi-node and foreign launchers: one training program, whatever started it.

``ddpkit.init()`` reads the process's place from the launcher's own variables (torchrun,
SLURM, OpenMPI, PMI), so this file runs unchanged under each of:

    ddpkit launch --nproc-per-node 2 examples/40_mpi_train.py --out params.pt
    ddpkit launch --nnodes 2 --nproc-per-node 1 --rdzv-endpoint 10.0.0.1:29400 \\
        examples/40_mpi_train.py --out params.pt          # on each of two hosts
    mpirun -n 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29533 \\
        python examples/40_mpi_train.py --out params.pt   # OpenMPI, gloo underneath
    srun --ntasks-per-node 2 python examples/40_mpi_train.py   # SLURM, MASTER_PORT exported

Every rank prints one ``WORLD {...}`` line (its view of the job) and rank 0 saves the
final parameters, so runs under different launchers can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn as nn
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpkit

GLOBAL_BATCH = 64  # fixed: every world size sees the same samples per step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--out", default=None, help="rank 0 saves the final state_dict here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    digits = load_digits()
    x_all = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y_all = torch.tensor(digits.target)
    # gloo on every launcher: this example is about who starts the processes, not devices.
    with ddpkit.distributed(backend="gloo") as world:
        line = "WORLD " + json.dumps({
            "rank": world.rank, "local_rank": world.local_rank, "world_size": world.world_size,
            "local_world_size": world.local_world_size, "node_rank": world.node_rank,
            "nnodes": world.nnodes, "source": world.source,
        }) + "\n"
        # One write per line: ranks share the launcher's pipe, and an unbuffered print
        # (PYTHONUNBUFFERED) writes text and newline separately, letting lines interleave.
        os.write(sys.stdout.fileno(), line.encode())
        if GLOBAL_BATCH % world.world_size:
            raise SystemExit(f"world size {world.world_size} must divide {GLOBAL_BATCH}")
        torch.manual_seed(args.seed)  # same initial weights everywhere (DDP broadcasts anyway)
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        ddp_model = DDP(model)
        opt = torch.optim.SGD(ddp_model.parameters(), lr=args.lr)
        order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(args.seed))
        for step in range(args.steps):
            start = (step * GLOBAL_BATCH) % (len(order) - GLOBAL_BATCH)
            batch = order[start:start + GLOBAL_BATCH][world.rank::world.world_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp_model(x_all[batch]), y_all[batch])
            loss.backward()
            opt.step()
        if world.is_main:
            if args.steps:
                print(f"final loss (rank 0 shard) {loss.item():.4f}", flush=True)
            if args.out:
                torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
