"""Every collective once, each printing what it left on every rank (PyTorch's distributed
tutorial).

Run:  ddpkit launch --nproc-per-node 3 examples/08_collectives.py
"""

import torch
import torch.distributed as dist


def show(name: str, rank: int, value) -> None:
    if isinstance(value, list):
        value = [t.tolist() for t in value]
    elif isinstance(value, torch.Tensor):
        value = value.tolist()
    print(f"{name:<10} rank {rank}: {value}")


def run(rank: int, size: int) -> None:
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=0)  # everyone gets rank 0's tensor
    show("broadcast", rank, t)

    t = torch.tensor([float(rank + 1)])
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # only dst's result is defined
    show("reduce", rank, t if rank == 0 else "(undefined off dst)")

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    show("all_reduce", rank, t)

    out = torch.zeros(1)
    chunks = [torch.tensor([10.0 * i]) for i in range(size)] if rank == 0 else None
    dist.scatter(out, scatter_list=chunks, src=0)  # rank i gets chunk i of src's list
    show("scatter", rank, out)

    t = torch.tensor([float(rank)])
    gathered = [torch.zeros(1) for _ in range(size)] if rank == 0 else None
    dist.gather(t, gather_list=gathered, dst=0)
    show("gather", rank, gathered if rank == 0 else "(only dst receives)")

    everyone = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(everyone, torch.tensor([float(rank)]))
    show("all_gather", rank, everyone)

    dist.barrier()  # nobody passes until everyone has arrived
    show("barrier", rank, "passed")

    send = [torch.tensor([float(rank * 10 + j)]) for j in range(size)]  # item j goes to rank j
    recv = [torch.zeros(1) for _ in range(size)]
    dist.all_to_all(recv, send)  # gloo supports all_to_all on CPU tensors
    show("all_to_all", rank, recv)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
