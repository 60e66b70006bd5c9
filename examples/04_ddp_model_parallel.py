"""PyTorch's DDP tutorial's DDP + model parallel demo: each replica spans two devices.

The model places its two halves on dev0 and dev1 itself and moves activations between
them in forward, so DDP gets no device_ids (it must not scatter inputs to one device).
On a machine with 2 GPUs per process, rank r uses GPUs 2r and 2r+1; on CPU both
"devices" are the CPU, which runs the same code path.

Run:  ddpkit launch --nproc-per-node 2 examples/04_ddp_model_parallel.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyMpModel(nn.Module):
    def __init__(self, dev0: torch.device, dev1: torch.device):
        super().__init__()
        self.dev0 = dev0
        self.dev1 = dev1
        self.net1 = torch.nn.Linear(10, 10).to(dev0)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5).to(dev1)

    def forward(self, x):
        x = x.to(self.dev0)
        x = self.relu(self.net1(x))
        x = x.to(self.dev1)
        return self.net2(x)


def devices_for(local_rank: int) -> tuple[torch.device, torch.device]:
    enough = torch.accelerator.is_available() and (
        torch.accelerator.device_count() >= 2 * (local_rank + 1))
    if enough:
        kind = torch.accelerator.current_accelerator().type
        return torch.device(kind, 2 * local_rank), torch.device(kind, 2 * local_rank + 1)
    return torch.device("cpu"), torch.device("cpu")


def demo_model_parallel(rank: int, dev0: torch.device, dev1: torch.device) -> None:
    print(f"Running DDP with model parallel example on rank {rank} ({dev0}, {dev1}).")
    mp_model = ToyMpModel(dev0, dev1)
    ddp_mp_model = DDP(mp_model)  # no device_ids: the module spans devices

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_mp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_mp_model(torch.randn(20, 10))  # outputs are on dev1
    labels = torch.randn(20, 5).to(dev1)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    checksum = sum(p.detach().sum().item() for p in mp_model.parameters())
    print(f"Finished DDP model parallel example on rank {rank}: parameter checksum {checksum:.6f}")


def main() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev0, dev1 = devices_for(local_rank)
    if dev0.type != "cpu":
        torch.accelerator.set_device_index(dev0.index)
    dist.init_process_group(backend=dist.get_default_backend_for_device(dev0))
    try:
        demo_model_parallel(dist.get_rank(), dev0, dev1)
        # Leave together: a rank that closes its connections while a peer is still in
        # its last collective would fail that peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
