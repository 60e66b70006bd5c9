"""Coming from torch DDP + torchrun: an ordinary torchrun script, one import changed.

This is the script a torch user already has (init_process_group from torchrun's
variables, DistributedSampler, DDP, rank 0 saves). The only ddpkit line is the import of
DDP; put torch's import back and it is the torch program again, bit for bit the same
result (tests/test_migrating.py runs both and compares the saved parameters). The
command line does not change either: `torchrun` becomes `ddpkit launch`, same flags.

Run:  ddpkit launch --standalone --nproc-per-node 2 examples/60_from_torch_ddp.py --save model.pt
 was: torchrun --standalone --nproc-per-node 2 examples/60_from_torch_ddp.py --save model.pt
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpkit import DataParallel as DDP


def make_data(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()  # 4 classes
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save", default=None, help="rank 0 writes the trained state_dict here")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()

    dataset = make_data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    model = DDP(net, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)  # summed loss, batches
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)  # every rank reduces, rank 0 prints
        if rank == 0:
            print(f"epoch {epoch}: mean loss {(total[0] / total[1]).item():.4f}", flush=True)

    if rank == 0 and args.save:
        torch.save(model.module.state_dict(), args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
