"""A user's own model and data for `--model user_recipe:make_model --data
user_recipe:make_data` (tests put this directory on the Python path)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class TwoLayer(nn.Module):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 24)
        self.fc2 = nn.Linear(24, num_classes)

    def forward(self, x):
        return F.log_softmax(self.fc2(torch.tanh(self.fc1(x.flatten(1)))), dim=1)


def make_model(input_shape, num_classes):
    return TwoLayer(int(torch.tensor(input_shape).prod()), num_classes)


def make_data():
    """Three separable classes in 6 dimensions: (train, test) as (inputs, labels)."""
    g = torch.Generator().manual_seed(7)
    centers = torch.randn(3, 6, generator=g) * 3

    def split(n):
        y = torch.randint(0, 3, (n,), generator=g)
        return centers[y] + torch.randn(n, 6, generator=g), y

    return split(240), split(60)


def not_a_model(input_shape, num_classes):
    return "a string"


class DropoutNet(nn.Module):
    """Dropout between two hidden layers: training draws random masks every step."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return F.log_softmax(self.fc3(self.drop(F.relu(self.fc2(x)))), dim=1)


def make_dropout_model(input_shape, num_classes):
    return DropoutNet(int(torch.tensor(input_shape).prod()), num_classes)
