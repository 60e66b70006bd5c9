"""The DDP tutorial's basic demo on ddpkit's own engine: ddpkit.DataParallel instead of
torch's DDP.

Same program as the tutorial's demo_basic; the one-line difference is the wrapper.
DataParallel broadcasts rank 0's parameters in its constructor, reduces gradients in
buckets while backward runs, and returns from backward() with averaged gradients, so
every rank ends with the same parameters. ``--engine torch`` runs the same script on
torch's DistributedDataParallel through ddpkit.parallel.data_parallel.

Run:  ddpkit launch --nproc-per-node 2 examples/20_ddpkit_engine.py [--engine torch]
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

import ddpkit
from ddpkit.parallel import data_parallel


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(world: ddpkit.World, engine: str) -> list[float]:
    print(f"Running basic DDP example on rank {world.rank} with engine {engine}.")
    device = torch.device(world.device)
    torch.manual_seed(world.rank)  # different inits on purpose: the wrapper syncs them
    model = ToyModel().to(device)
    ddp_model = data_parallel(model, engine=engine)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    for _ in range(3):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, device=device))
        labels = torch.randn(20, 5, device=device)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    # Every rank reduces, rank 0 prints: gather each rank's parameter checksum.
    checksum = torch.tensor([sum(p.detach().double().sum().item() for p in model.parameters())])
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world.world_size)]
    dist.all_gather(sums, checksum.to(torch.float64))
    print(f"Finished running basic DDP example on rank {world.rank}.")
    return [s.item() for s in sums]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["ddpkit", "torch"], default="ddpkit")
    args = parser.parse_args()
    with ddpkit.distributed() as world:
        sums = demo_basic(world, args.engine)
        if world.rank == 0:
            print(f"parameter checksums per rank: {sums}; identical: {len(set(sums)) == 1}")


if __name__ == "__main__":
    main()
