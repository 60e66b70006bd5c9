"""From PyTorch's distributed tutorial: blocking point-to-point. Rank 0 sends a tensor to rank 1.

Run:  ddpkit launch --nproc-per-node 2 examples/05_p2p_blocking.py
"""

import torch
import torch.distributed as dist


def run(rank: int, size: int) -> None:
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)  # returns once the data has left (or been buffered)
    elif rank == 1:
        dist.recv(tensor=tensor, src=0)  # blocks until the data is here
    print("Rank ", rank, " has data ", tensor[0])


if __name__ == "__main__":
    dist.init_process_group("gloo")  # rank, size, address: from the launcher's environment
    run(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
