"""From PyTorch's distributed tutorial: non-blocking point-to-point with isend/irecv and wait().

Until wait() returns, the sender must not write the tensor and the receiver must not
read it: the transfer may still be in flight.

Run:  ddpkit launch --nproc-per-node 2 examples/06_p2p_nonblocking.py
"""

import torch
import torch.distributed as dist


def run(rank: int, size: int) -> None:
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        req = dist.isend(tensor=tensor, dst=1)
        print("Rank 0 started sending")
    elif rank == 1:
        req = dist.irecv(tensor=tensor, src=0)
        print("Rank 1 started receiving")
    if req is not None:
        req.wait()
    print("Rank ", rank, " has data ", tensor[0])


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
