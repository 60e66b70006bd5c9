"""The names ddpkit's options accept: one table per vocabulary, no copies.

Each table maps a name to the ``module:attribute`` that implements it and a line of
help. The target is imported only when a name is resolved, so the launching
``ddpkit train`` offers the choices, checks a config and prints ``--help`` without
importing torch (which costs it more than a second), while the workers resolve the same
names to the real objects. Adding a model, a dataset, an optimizer or a schedule is one
entry here (plus the code it names); ``--help``, the config checks and the builders all
read the table.

What each kind of target is called with:

* ``DATASETS``: a :class:`ddpkit.data.datasets.DatasetSpec` (shape, classes, loader);
* ``MODELS``: ``build(input_shape, num_classes, hidden) -> nn.Module``;
* ``OPTIMIZERS``: ``build(params, optim_cfg) -> torch.optim.Optimizer``;
* ``SCHEDULES``: ``lr(base_lr, step, warmup_steps, total_steps) -> float`` after warm-up;
* ``PRECISIONS``: the autocast dtype (float32 meaning no autocast);
* ``ENGINES``: the DDP class the engine wraps a model in;
* ``COMM_CHOICES``: a transport class taking the group (``auto``: the function that
  picks one of the others);
* ``SHARD_CHOICES``: the ZeRO stage's name only (the engine branches on it).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ddpkit.errors import ConfigError


@dataclass(frozen=True)
class Entry:
    target: str | None  # "package.module:attr.attr", imported on first resolve
    help: str


class Registry(Mapping[str, Entry]):
    """A vocabulary: names in the order they are listed, each resolved lazily."""

    def __init__(self, what: str, entries: Mapping[str, Entry]):
        self.what = what
        self._entries = dict(entries)
        self._resolved: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {tuple(self._entries)})"

    def add(self, name: str, target: str, help: str = "") -> None:
        """One more name (an extension, or a test's own model or dataset)."""
        if name in self._entries:
            raise ConfigError(f"{self.what} {name!r} is already registered "
                              f"(as {self._entries[name].target})")
        self._entries[name] = Entry(target, help)

    def remove(self, name: str) -> None:
        self._entries.pop(name)
        self._resolved.pop(name, None)

    def check(self, name: str, flag: str | None = None) -> str:
        """``name`` if it is one of the table's; else a one-line ConfigError (naming the
        command-line ``flag`` that gave it, where one did)."""
        if name not in self._entries:
            choices = ", ".join(self._entries)
            raise ConfigError(f"{flag} {name!r} is not one of {choices}" if flag else
                              f"unknown {self.what} {name!r}; choose one of {choices}")
        return name

    def resolve(self, name: str, flag: str | None = None) -> Any:
        """The object ``name`` stands for (imported the first time)."""
        self.check(name, flag)
        if name not in self._resolved:
            target = self._entries[name].target
            if target is None:
                raise ConfigError(f"{self.what} {name!r} names no object to resolve")
            module, _, attrs = target.partition(":")
            value: Any = importlib.import_module(module)
            for attr in attrs.split("."):
                value = getattr(value, attr)
            self._resolved[name] = value
        return self._resolved[name]

    def described(self) -> str:
        """``name (help), name (help)`` for a ``--help`` line."""
        return ", ".join(f"{n} ({e.help})" if e.help else n for n, e in self._entries.items())


DATASETS = Registry("dataset", {
    "digits": Entry("ddpkit.data.datasets:DIGITS",
                    "scikit-learn's 1,797 8x8 handwritten digits, shipped with it"),
    "mnist": Entry("ddpkit.data.datasets:MNIST", "the four MNIST IDX files in --data-dir"),
    "synthetic": Entry("ddpkit.data.datasets:SYNTHETIC",
                       "a linearly separable set of --synthetic-size 8x8 samples"),
})

MODELS = Registry("model", {
    "mlp": Entry("ddpkit.train.models:build_mlp", "multilayer perceptron, any input shape"),
    "net": Entry("ddpkit.train.models:build_net", "the MNIST tutorial's CNN, 1x28x28 input"),
    "toy": Entry("ddpkit.train.models:build_toy", "the DDP tutorial's ToyModel"),
})

OPTIMIZERS = Registry("optimizer", {
    "sgd": Entry("ddpkit.train.optimizers:sgd", "SGD with momentum and weight decay"),
    "adamw": Entry("ddpkit.train.optimizers:adamw", "AdamW, decoupled weight decay"),
})

SCHEDULES = Registry("learning-rate schedule", {
    "constant": Entry("ddpkit.train.recipe:constant_lr", "the base rate after warm-up"),
    "cosine": Entry("ddpkit.train.recipe:cosine_lr", "half a cosine down to 0 at the end"),
})

PRECISIONS = Registry("precision", {
    "fp32": Entry("torch:float32", "no autocast"),
    "bf16": Entry("torch:bfloat16", "autocast to bfloat16"),
    "fp16": Entry("torch:float16", "autocast to float16 with a GradScaler, CUDA only"),
})

ENGINES = Registry("DDP engine", {
    "ddpkit": Entry("ddpkit.parallel:DataParallel", "ddpkit's own engine"),
    "torch": Entry("torch.nn.parallel:DistributedDataParallel", "torch's own"),
})

COMM_CHOICES = Registry("comm", {
    "auto": Entry("ddpkit.parallel.engine.transport:choose",
                  "shared memory on one host's CPUs, else the backend"),
    "backend": Entry("ddpkit.parallel.engine.transport:BackendTransport",
                     "the process group's own all-reduce"),
    "ring": Entry("ddpkit.parallel.engine.transport:RingTransport",
                  "ddpkit's segmented ring on point-to-point messages"),
    "shm": Entry("ddpkit.parallel.engine.transport:ShmTransport",
                 "ddpkit's shared-memory sum, one host"),
})

SHARD_CHOICES = Registry("shard mode", {
    "none": Entry(None, "plain DDP"),
    "optimizer": Entry(None, "ZeRO-1: optimizer state sharded"),
    "gradients": Entry(None, "ZeRO-2: gradients too"),
    "parameters": Entry(None, "ZeRO-3: parameters too"),
})
