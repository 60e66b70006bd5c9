"""Models the trainer builds by name. All return log-probabilities (use ``nll_loss``).

* ``net`` - the distributed tutorial's MNIST ``Net`` (two conv layers, dropout, two
  linear layers); it needs 28x28 images.
* ``mlp`` - a small multilayer perceptron; fits any input shape (default for digits).
* ``toy`` - the DDP tutorial's ``ToyModel`` (Linear-ReLU-Linear, 10 hidden units), with
  its input and output widths taken from the data instead of the fixed 10 -> 5.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.errors import ConfigError
from ddpkit.vocabulary import MODELS


class Net(nn.Module):
    """The tutorial's MNIST network (from PyTorch's MNIST example)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        # Modules rather than F.dropout so `ddpkit verify` can switch dropout off alone.
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc_drop = nn.Dropout()
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = self.fc_drop(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


class MLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (128,)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.layers(x), dim=1)


class ToyModel(nn.Module):
    """The DDP tutorial's ToyModel: net1 -> ReLU -> net2."""

    def __init__(self, in_features: int = 10, num_classes: int = 5):
        super().__init__()
        self.flatten = nn.Flatten()
        self.net1 = nn.Linear(in_features, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.net2(self.relu(self.net1(self.flatten(x)))), dim=1)


def build_net(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int]) -> Net:
    if tuple(input_shape) != (1, 28, 28):
        raise ConfigError(
            f"model 'net' is the tutorial's MNIST network and needs 1x28x28 images, "
            f"the data has {'x'.join(map(str, input_shape))}; use --data mnist or --model mlp"
        )
    return Net(num_classes)


def build_mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int]) -> MLP:
    if not hidden or any(h < 1 for h in hidden):
        raise ConfigError(f"MLP hidden sizes must be positive integers, got {list(hidden)}")
    return MLP(math.prod(input_shape), num_classes, hidden)


def build_toy(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int]) -> ToyModel:
    return ToyModel(math.prod(input_shape), num_classes)


def builtin_model(
    name: str, input_shape: Sequence[int], num_classes: int, *, hidden: Sequence[int] = (128,)
) -> nn.Module:
    """A fresh model of :data:`ddpkit.vocabulary.MODELS` for data of ``input_shape`` (one
    sample, no batch dimension)."""
    return MODELS.resolve(name)(input_shape, num_classes, hidden)
