"""Sharded data: the tutorial's DataPartitioner, a resumable ShardSampler, named datasets."""

from ddpkit.data.datasets import DATASETS, ArrayDataset, load_dataset, load_digits, load_mnist
from ddpkit.data.partition import (
    DataPartitioner,
    Partition,
    ShardBatch,
    ShardSampler,
    local_batch_size,
)

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "DataPartitioner",
    "Partition",
    "ShardBatch",
    "ShardSampler",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "local_batch_size",
]
