"""From PyTorch's distributed tutorial: all-reduce inside a group of ranks [0, 1].

Every rank must call new_group (even ranks outside it), in the same order; only
members take part in the group's collectives.

Run:  ddpkit launch --nproc-per-node 2 examples/07_allreduce_group.py
"""

import torch
import torch.distributed as dist


def run(rank: int, size: int) -> None:
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    if rank in (0, 1):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0])


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
