"""Bucket assignment and storage: pure logic, no processes."""

import pytest
import torch

from ddpkit.errors import ConfigError
from ddpkit.parallel import data_parallel
from ddpkit.parallel.engine.buckets import MIB, assign_buckets, build_buckets, size_limits


def _f32(numel):
    return torch.empty(numel, dtype=torch.float32)


def test_reverse_order_small_first_bucket_then_cap():
    # 4-byte floats: sizes 100 B, 400 B, 100 B, 2000 B, 100 B
    tensors = [_f32(25), _f32(100), _f32(25), _f32(500), _f32(25)]
    order = list(reversed(range(len(tensors))))
    buckets = assign_buckets(tensors, order, [200, 1000])
    # first bucket closes as soon as it reaches 200 B; later ones at 1000 B; a big tensor
    # is never split, it closes its bucket on its own
    assert buckets == [[4, 3], [2, 1, 0]]


def test_separate_buckets_per_dtype():
    tensors = [_f32(10), torch.empty(10, dtype=torch.float64), _f32(10),
               torch.empty(10, dtype=torch.float64)]
    buckets = assign_buckets(tensors, [3, 2, 1, 0], [10 * MIB])
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]
    for bucket in buckets:
        assert len({tensors[i].dtype for i in bucket}) == 1


def test_follows_the_given_order():
    tensors = [_f32(10) for _ in range(4)]
    assert assign_buckets(tensors, [2, 0, 3, 1], [80]) == [[2, 0], [3, 1]]


def test_size_limits():
    assert size_limits(25, None) == [MIB, 25 * MIB]
    assert size_limits(0.5, None) == [MIB // 2]  # first bucket never exceeds the cap
    assert size_limits(4, 4) == [4 * MIB]
    with pytest.raises(ValueError):
        size_limits(0, None)
    with pytest.raises(ValueError):
        assign_buckets([_f32(1)], [0], [])


def test_gradient_views_share_bucket_storage():
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    (bucket,) = build_buckets(params, [[1, 0]])
    assert bucket.buffer.numel() == 17
    bucket.buffer.copy_(torch.arange(17.0))
    assert bucket.views[0].shape == (5,) and bucket.views[1].shape == (3, 4)
    assert torch.equal(bucket.views[0], torch.arange(5.0))
    assert torch.equal(bucket.views[1].reshape(-1), torch.arange(5.0, 17.0))


def test_allocator_result_is_checked():
    params = [torch.nn.Parameter(torch.randn(4))]
    with pytest.raises(ValueError, match="need 4 x torch.float32"):
        build_buckets(params, [[0]], lambda n, dtype, device: torch.zeros(2, dtype=dtype))


def test_data_parallel_rejects_unknown_engine_and_option():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="unknown DDP engine 'tf'"):
        data_parallel(model, engine="tf")
    with pytest.raises(ConfigError, match="bucket_size"):
        data_parallel(model, bucket_size=3)


def test_data_parallel_needs_a_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="ddpkit.init"):
        data_parallel(torch.nn.Linear(2, 2))
