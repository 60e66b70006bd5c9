"""The DDP tutorial's checkpoint demo: save on rank 0, barrier, load everywhere with map_location.

Saving from one process is enough because DDP keeps replicas identical (same start, same
averaged gradients, same optimizer step). The barrier keeps other ranks from reading the
file before rank 0 has finished writing it; map_location sends tensors saved from rank
0's device to this rank's device instead of piling every process onto device 0.
The checkpoint lives in a private temporary directory, not a fixed /tmp path, so two
runs never overwrite each other's file.

Run:  ddpkit launch --nproc-per-node 2 examples/03_ddp_checkpoint.py
"""

import os
import tempfile

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


def shared_checkpoint_dir(rank: int) -> str:
    """Rank 0 makes a fresh directory and tells the others its name."""
    name = [tempfile.mkdtemp(prefix="ddpkit-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def demo_checkpoint(rank: int, device: torch.device) -> None:
    print(f"Running DDP checkpoint example on rank {rank}.")
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)

    checkpoint_path = os.path.join(shared_checkpoint_dir(rank), "model.checkpoint")
    if rank == 0:
        # All processes hold the same parameters, so saving in one is sufficient.
        torch.save(ddp_model.state_dict(), checkpoint_path)
    # Nobody loads before rank 0 has finished writing.
    dist.barrier()
    # Tensors were saved from rank 0's device; put them on this rank's device.
    saved_on = torch.device(device.type, 0) if device.type != "cpu" else device
    map_location = {str(saved_on): str(device)}
    ddp_model.load_state_dict(
        torch.load(checkpoint_path, map_location=map_location, weights_only=True))

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10, device=device))
    labels = torch.randn(20, 5, device=device)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    # No barrier needed before deleting: the all-reduce in backward already proved every
    # rank finished loading.
    if rank == 0:
        os.remove(checkpoint_path)
        os.rmdir(os.path.dirname(checkpoint_path))
    checksum = sum(p.detach().sum().item() for p in model.parameters())
    print(f"Finished DDP checkpoint example on rank {rank}: parameter checksum {checksum:.6f}")


def main() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.accelerator.is_available():
        device = torch.device(torch.accelerator.current_accelerator().type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=dist.get_default_backend_for_device(device))
    try:
        demo_checkpoint(dist.get_rank(), device)
        # Leave together: a rank that closes its connections while a peer is still in
        # its last collective would fail that peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
