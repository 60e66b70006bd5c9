"""The names the training configuration accepts, readable without importing the code
that implements them (ddpkit.data, ddpkit.parallel and the models import torch, which
costs the launching ``ddpkit train`` more than a second it does not otherwise need).

Each table is its library's own list, copied; tests/test_train_config.py checks that
they are equal, so a name added there and not here fails a test.
"""

DATASETS = ("digits", "mnist", "synthetic")  # ddpkit.data.datasets.DATASETS
MODELS = ("mlp", "net", "toy")  # ddpkit.train.models.MODELS
ENGINES = ("ddpkit", "torch")  # ddpkit.parallel.ENGINES
COMM_CHOICES = ("auto", "backend", "ring", "shm")  # ddpkit.parallel.COMM_CHOICES
SHARD_CHOICES = ("none", "optimizer", "gradients", "parameters")  # ddpkit.parallel.SHARD_CHOICES
EXIT_PREEMPTED = 75  # ddpkit.fault.EXIT_PREEMPTED
