"""From PyTorch's distributed tutorial: the reduce operators, each on the dtypes it applies to.

SUM, PRODUCT, MIN, MAX work on any number; BAND, BOR, BXOR only on integers; AVG is
NCCL-only (gloo divides nothing), so on gloo we SUM and divide; PREMUL_SUM is NCCL-only.

Run:  ddpkit launch --nproc-per-node 2 examples/09_reduce_ops.py
"""

import torch
import torch.distributed as dist

FLOAT_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
}
BITWISE_OPS = {"BAND": dist.ReduceOp.BAND, "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}


def run(rank: int, size: int) -> None:
    for name, op in FLOAT_OPS.items():
        t = torch.tensor([rank + 2.0, -(rank + 1.0)])
        dist.all_reduce(t, op=op)
        print(f"rank {rank} {name:<7} float32 -> {t.tolist()}")
    for name, op in BITWISE_OPS.items():
        t = torch.tensor([0b1100 | rank, 0b0011 << rank], dtype=torch.int64)
        dist.all_reduce(t, op=op)
        print(f"rank {rank} {name:<7} int64   -> {t.tolist()}")
    t = torch.tensor([float(rank)])
    if dist.get_backend() == "nccl":
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
    else:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= size
    print(f"rank {rank} AVG     float32 -> {t.tolist()}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
