"""PyTorch's DDP tutorial's basic DDP demo, started from Python instead of a launcher.

The tutorial uses mp.spawn with a hard-coded MASTER_PORT (12355); ddpkit.spawn gives each
run a private FileStore instead, so two copies of this script never collide.

Run:  python examples/02_ddp_basic_spawn.py
"""

import torch
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpkit


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(world: ddpkit.World) -> float:
    print(f"Running basic DDP example on rank {world.rank}.")
    device = torch.device(world.device)
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10, device=device))
    loss_fn(outputs, torch.randn(20, 5, device=device)).backward()
    optimizer.step()
    print(f"Finished running basic DDP example on rank {world.rank}.")
    return sum(p.sum().item() for p in model.parameters())


if __name__ == "__main__":
    sums = ddpkit.spawn(demo_basic, nprocs=2)
    # DDP keeps replicas identical: every rank ends with the same parameters.
    print(f"parameter sums per rank: {sums}; identical: {len(set(sums)) == 1}")
