"""Distributed Synchronous SGD from PyTorch's distributed tutorial: partition the data,
average the gradients.

The tutorial's program, kept close to its shape: ``partition_dataset()`` gives each rank
its own shard through ``DataPartitioner`` and divides the global batch of 128 by the
world size; ``average_gradients()`` all-reduces every gradient and divides by the world
size; every rank prints ``Rank r, epoch e: loss``. It trains on scikit-learn's digits
(no download) by default, or on MNIST from local IDX files with ``--data-dir``.

Run:  ddpkit launch --nproc-per-node 2 examples/30_sync_sgd_mnist.py
      ddpkit launch --nproc-per-node 2 examples/30_sync_sgd_mnist.py --data-dir ~/data/mnist
(`ddpkit train` is the full version: exact metrics, progress, run directory, plots.)
"""

from __future__ import annotations

import argparse
from math import ceil

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim

from ddpkit.data import DataPartitioner, load_dataset
from ddpkit.train.models import MLP, Net

GLOBAL_BATCH = 128


def partition_dataset(data_dir: str | None):
    """This rank's shard of the training set and the per-rank batch size."""
    train, _ = load_dataset("mnist" if data_dir else "digits", data_dir)
    dataset = list(zip(train.x, train.y, strict=True))  # (image, label) pairs, as torchvision
    size = dist.get_world_size()
    bsz = GLOBAL_BATCH // size
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes).use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition, batch_size=bsz, shuffle=True)
    return train_set, bsz


def average_gradients(model: torch.nn.Module) -> None:
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run(rank: int, size: int, data_dir: str | None = None, epochs: int = 10) -> list[float]:
    torch.manual_seed(1234)
    train_set, bsz = partition_dataset(data_dir)
    # The tutorial's Net needs 28x28 MNIST; digits are 8x8, so they get a small MLP.
    model = Net() if data_dir else MLP(64, 10)
    # The tutorial's lr=0.01, momentum=0.5 is tuned for MNIST's 469 steps per epoch;
    # digits has 12, so it takes bigger steps.
    optimizer = optim.SGD(model.parameters(), lr=0.01 if data_dir else 0.1, momentum=0.5)

    num_batches = ceil(len(train_set.dataset) / float(bsz))
    losses = []
    for epoch in range(epochs):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        losses.append(epoch_loss / num_batches)
        print("Rank ", dist.get_rank(), ", epoch ", epoch, ": ", losses[-1])
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="folder with the MNIST IDX files")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # ranks and rendezvous come from the launcher
    try:
        run(dist.get_rank(), dist.get_world_size(), args.data_dir, args.epochs)
    finally:
        dist.destroy_process_group()
