"""Named datasets: digits equals scikit-learn's, MNIST IDX parsing and its errors, synthetic."""

import gzip
import struct

import numpy as np
import pytest
import torch

from ddpkit.data import load_dataset, load_digits, load_mnist
from ddpkit.data.datasets import MNIST_FILES, read_idx
from ddpkit.errors import ConfigError


def test_digits_is_scikit_learns_digits_split_deterministically():
    from sklearn.datasets import load_digits as sk_load

    bunch = sk_load()
    train, test = load_digits()
    assert len(train) + len(test) == 1797 and len(test) == 359
    assert train.input_shape == (1, 8, 8) and train.num_classes == 10
    assert abs(train.x.mean().item()) < 1e-4 and train.x.std().item() == pytest.approx(1, abs=1e-4)
    # Standardization is one affine map; pixels span 0..16, so min/max undo it.
    x = torch.cat([train.x, test.x]).reshape(-1, 64).double()
    lo, hi = train.x.min().double(), train.x.max().double()
    raw = torch.round(16 * (x - lo) / (hi - lo)).to(torch.int64)
    ours = sorted(zip(map(tuple, raw.tolist()), torch.cat([train.y, test.y]).tolist()))
    theirs = sorted(zip(map(tuple, bunch.data.astype(int).tolist()), bunch.target.tolist()))
    assert ours == theirs
    again_train, again_test = load_digits()
    assert torch.equal(again_train.x, train.x) and torch.equal(again_test.y, test.y)


def _write_idx(path, array, gz=False):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


def _fake_mnist(folder, gz=False, n_train=12, n_test=5):
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28)),
        "train_labels": rng.integers(0, 10, n_train),
        "test_images": rng.integers(0, 256, (n_test, 28, 28)),
        "test_labels": rng.integers(0, 10, n_test),
    }
    for key, stem in MNIST_FILES.items():
        _write_idx(folder / (stem + (".gz" if gz else "")), arrays[key], gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_raw_and_gzipped_idx_with_the_tutorials_normalization(tmp_path, gz):
    arrays = _fake_mnist(tmp_path, gz)
    train, test = load_mnist(tmp_path)
    assert train.x.shape == (12, 1, 28, 28) and len(test) == 5
    expected = (torch.from_numpy(arrays["train_images"]).float() / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(train.x[:, 0], expected)
    assert train.y.tolist() == arrays["train_labels"].tolist()


def test_mnist_in_torchvision_layout(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    _fake_mnist(raw)
    assert len(load_dataset("mnist", tmp_path)[0]) == 12


def test_missing_mnist_file_is_named_with_where_to_get_it(tmp_path):
    _fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError, match=r"t10k-labels-idx1-ubyte .*not found.*download"):
        load_mnist(tmp_path)
    with pytest.raises(ConfigError, match="needs --data-dir"):
        load_dataset("mnist", None)
    with pytest.raises(ConfigError, match="not a directory"):
        load_mnist(tmp_path / "nope")


def test_malformed_idx_is_reported_with_its_path(tmp_path):
    bad = tmp_path / "x-idx3-ubyte"
    bad.write_bytes(b"\x00\x00\x08\x03" + struct.pack(">3I", 10, 28, 28) + b"\x00" * 100)
    with pytest.raises(ConfigError, match=r"x-idx3-ubyte is not a valid IDX file .*promises"):
        read_idx(bad, expect_dims=3)
    bad.write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ConfigError, match="magic number"):
        read_idx(bad, expect_dims=3)
    gz = tmp_path / "y.gz"
    gz.write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError, match="cannot read it"):
        read_idx(gz, expect_dims=1)


def test_synthetic_is_seeded_and_learnable_shape():
    (a, at), (b, _) = load_dataset("synthetic", synthetic_size=100), load_dataset(
        "synthetic", synthetic_size=100)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert len(a) == 100 and len(at) == 25 and a.input_shape == (1, 8, 8)
    assert len(a.y.unique()) > 5


def test_unknown_dataset():
    with pytest.raises(ConfigError, match="unknown dataset 'cifar'"):
        load_dataset("cifar")
