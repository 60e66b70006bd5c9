"""Datasets the trainer knows by name; all load from local files, none touch the network.

* ``digits`` - the 1,797 8x8 handwritten digits that ship inside scikit-learn. We read the
  packaged CSV directly (the same bytes ``sklearn.datasets.load_digits`` reads) because
  importing scikit-learn would cost every worker's start many times the read itself
  (benchmarks/RESULTS-history.md, start-up); ``load_digits`` is the fallback.
* ``mnist`` - MNIST from the four IDX files (raw or ``.gz``) in ``--data-dir``, normalized
  as in the tutorial: ``(x / 255 - 0.1307) / 0.3081``.
* ``synthetic`` - a seeded teacher-labelled Gaussian problem, any size, for benchmarks.

Each loader returns ``(train, test)`` :class:`ArrayDataset` pairs: whole tensors in
memory, so a batch is one fancy-index, not ``batch_size`` Python calls.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddpkit.errors import ConfigError
from ddpkit.vocabulary import DATASETS

MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/ (or http://yann.lecun.com/exdb/mnist/)"
MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# Held out from digits for testing; fixed so every run and every rank sees the same split.
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


@dataclass(eq=False)  # tensors do not compare to a bool
class ArrayDataset(torch.utils.data.Dataset):
    """Inputs ``x`` (N, ...) float32 and integer labels ``y`` (N,) held in memory."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ConfigError(f"{self.name}: {len(self.x)} inputs but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.x.device)
        return self.x[idx], self.y[idx]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


def load_dataset(
    name: str, data_dir: str | os.PathLike | None = None, *, synthetic_size: int = 8192
) -> tuple[ArrayDataset, ArrayDataset]:
    """``(train, test)`` for a dataset name in :data:`ddpkit.vocabulary.DATASETS`."""
    return DATASETS.resolve(name).load(data_dir, synthetic_size)


# --------------------------------------------------------------------------- digits
def _digits_array() -> np.ndarray:
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        csv = Path(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz")
        if csv.is_file():
            return np.loadtxt(csv, delimiter=",", dtype=np.float32)
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        raise ConfigError(
            "the digits dataset ships with scikit-learn, which is not installed; "
            "pip install scikit-learn, or use --data mnist/synthetic"
        ) from None
    bunch = sk_load_digits()
    return np.column_stack([bunch.data, bunch.target]).astype(np.float32)


def load_digits() -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's digits as (1, 8, 8) images, standardized with train-set statistics."""
    table = _digits_array()
    x = torch.from_numpy(table[:, :64] / 16.0).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(y)))
    n_test = int(round(len(y) * DIGITS_TEST_FRACTION))
    test_idx, train_idx = order[:n_test], order[n_test:]
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = ((x - mean) / std).float()
    return (
        ArrayDataset(x[train_idx], y[train_idx], 10, "digits-train"),
        ArrayDataset(x[test_idx], y[test_idx], 10, "digits-test"),
    )


# --------------------------------------------------------------------------- mnist
def _find_idx(data_dir: Path, stem: str) -> Path:
    # torchvision keeps the files in MNIST/raw; accept that layout as well as a flat one.
    for folder in (data_dir, data_dir / "MNIST" / "raw", data_dir / "raw"):
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    raise ConfigError(
        f"MNIST file {stem} (or {stem}.gz) not found in {data_dir}; "
        f"download the four IDX files from {MNIST_URL} into that directory"
    )


def read_idx(path: str | os.PathLike, *, expect_dims: int) -> np.ndarray:
    """An IDX file (ubyte data) as a numpy array; raw or gzip-compressed."""
    path = Path(path)

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"MNIST file {path} is not a valid IDX file ({why}); "
            f"download it again from {MNIST_URL}"
        )

    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:
        raise bad(f"cannot read it: {exc}") from None
    if len(raw) < 4:
        raise bad("shorter than its 4-byte header")
    zero, dtype_code, dims = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise bad(f"magic number {raw[:4].hex()} is not an unsigned-byte IDX header")
    if dims != expect_dims:
        raise bad(f"it has {dims} dimensions, expected {expect_dims}")
    header = 4 + 4 * dims
    if len(raw) < header:
        raise bad("its header is truncated")
    shape = struct.unpack(f">{dims}I", raw[4:header])
    expected = int(np.prod(shape))
    if len(raw) - header != expected:
        raise bad(f"header promises {expected} bytes of data for shape {shape}, "
                  f"file holds {len(raw) - header}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def load_mnist(data_dir: str | os.PathLike) -> tuple[ArrayDataset, ArrayDataset]:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise ConfigError(
            f"--data-dir {data_dir} is not a directory; put the MNIST IDX files from "
            f"{MNIST_URL} there"
        )
    arrays = {
        key: read_idx(_find_idx(data_dir, stem), expect_dims=3 if "images" in key else 1)
        for key, stem in MNIST_FILES.items()
    }

    def make(split: str) -> ArrayDataset:
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if len(images) != len(labels):
            raise ConfigError(
                f"MNIST {split} files disagree: {len(images)} images but {len(labels)} labels "
                f"in {data_dir}; download both again from {MNIST_URL}"
            )
        x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
        x = (x - 0.1307) / 0.3081  # the tutorial's normalization
        return ArrayDataset(x, torch.from_numpy(labels.astype(np.int64)), 10, f"mnist-{split}")

    return make("train"), make("test")


# --------------------------------------------------------------------------- synthetic
def make_synthetic(
    size: int = 8192, *, features: int = 64, num_classes: int = 10, seed: int = 0
) -> tuple[ArrayDataset, ArrayDataset]:
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, any size.

    Inputs are (1, 8, 8) like digits so every model that runs on digits runs here.
    ``size`` training samples plus a quarter as many for testing.
    """
    if size < 1:
        raise ConfigError(f"synthetic dataset size must be >= 1, got {size}")
    gen = torch.Generator().manual_seed(seed)
    n_test = max(size // 4, 1)
    x = torch.randn(size + n_test, features, generator=gen)
    teacher = torch.randn(features, num_classes, generator=gen)
    y = (x @ teacher).argmax(dim=1)
    x = x.reshape(-1, 1, 8, features // 8) if features % 8 == 0 else x
    return (
        ArrayDataset(x[:size], y[:size], num_classes, "synthetic-train"),
        ArrayDataset(x[size:], y[size:], num_classes, "synthetic-test"),
    )


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class DatasetSpec:
    """Everything the application knows of a dataset by name: the CLI's choices, the
    model-fits-the-data check before any process starts, and the loader."""

    input_shape: tuple[int, ...]  # one sample, no batch dimension
    num_classes: int
    load: Callable[[str | os.PathLike | None, int], tuple[ArrayDataset, ArrayDataset]]


def _mnist_from_option(data_dir: str | os.PathLike | None, _size: int):
    if data_dir is None:
        raise ConfigError(
            f"--data mnist needs --data-dir DIR holding the four MNIST IDX files "
            f"({', '.join(MNIST_FILES.values())}, raw or .gz); get them from {MNIST_URL}"
        )
    return load_mnist(data_dir)


# The specs ddpkit.vocabulary.DATASETS names (adding a dataset: a spec and its entry there).
DIGITS = DatasetSpec((1, 8, 8), 10, lambda _dir, _size: load_digits())
MNIST = DatasetSpec((1, 28, 28), 10, _mnist_from_option)
SYNTHETIC = DatasetSpec((1, 8, 8), 10, lambda _dir, size: make_synthetic(size))
