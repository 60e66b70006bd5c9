"""An SPMD program launched by torchrun (PyTorch's torchrun DDP example); ranks come from
the environment.

Run:  ddpkit launch --nproc-per-node 2 examples/01_spmd_main.py
 (or: torchrun --standalone --nproc-per-node 2 examples/01_spmd_main.py)
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(device: torch.device) -> None:
    print(f"[{os.getpid()}] rank = {dist.get_rank()}, world_size = {dist.get_world_size()}")
    model = ToyModel().to(device)
    # device_ids only for a single-accelerator module; on CPU DDP takes none.
    ddp_model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10, device=device))
    labels = torch.randn(20, 5, device=device)
    loss_fn(outputs, labels).backward()
    optimizer.step()


def spmd_main() -> None:
    env_dict = {
        key: os.environ[key] for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    local_rank = int(os.environ["LOCAL_RANK"])
    print(f"[{os.getpid()}] Initializing process group with: {env_dict}")
    if torch.accelerator.is_available():
        device = torch.device(torch.accelerator.current_accelerator().type, local_rank)
        torch.accelerator.set_device_index(local_rank)  # local rank, not global: multi-node safe
    else:
        device = torch.device("cpu")
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend=backend)
    print(
        f"[{os.getpid()}] world_size = {dist.get_world_size()}, "
        f"rank = {dist.get_rank()}, backend={dist.get_backend()}"
    )
    demo_basic(device)
    dist.destroy_process_group()


if __name__ == "__main__":
    spmd_main()
