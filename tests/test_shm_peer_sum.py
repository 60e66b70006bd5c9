"""Summing private tensors by reading peers' memory (comm/shm/peer_read.py, peer_sum.py):
results against torch's all_reduce, the iovec batching, the all-or-nothing probe, and a
layout mismatch that must become the same error on every rank."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed as dist

from ddpkit.comm.shm import peer_read
from ddpkit.errors import CommError

# empty, one, odd, more than one cache-sized piece (262,144 float32), then 1,500 tiny
# tensors so that one piece spans more segments than one syscall takes (1,024)
NUMELS = (0, 1, 7, 300_001, *([3] * 1500), 5)


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77 + rank)
    out = []
    for i, n in enumerate(NUMELS):
        if i % 3 == 2:
            out.append(torch.randint(-50, 50, (n,), generator=g, dtype=torch.int64))
        else:
            dtype = torch.float64 if i % 3 == 1 else torch.float32
            out.append(torch.randn(n, generator=g, dtype=dtype))
    return out


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def run_sum_against_torch(world, scale):
    from ddpkit.comm.shm import ShmCommunicator
    from ddpkit.comm.shm.peer_sum import PeerSum

    comm = ShmCommunicator()
    summer = PeerSum(comm, len(NUMELS))
    mine = _tensors(world.rank)
    floats = [t for t in mine if t.is_floating_point()]
    ints = [t for t in mine if not t.is_floating_point()]
    expected = []
    for t in floats:  # torch's reducer: every addend scaled, then summed
        e = t * scale if scale is not None else t.clone()
        dist.all_reduce(e)
        expected.append(e)
    expected_ints = []
    for t in ints:
        e = t.clone()
        dist.all_reduce(e)
        expected_ints.append(e)
    summer.sum_(floats, scale)
    summer.sum_(ints)
    worst = max((float((a - b).abs().max()) for a, b in zip(floats, expected) if a.numel()),
                default=0.0)
    result = {
        "usable": summer.usable,
        "worst": worst,
        "floats_equal": all(torch.equal(a, b) for a, b in zip(floats, expected)),
        "ints_equal": all(torch.equal(a, b) for a, b in zip(ints, expected_ints)),
        "digest": _digest(mine),
    }
    comm.close()
    return result


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_sums_equal_torch_and_replicas_are_identical(pools, world_size, scale):
    results = pools(world_size).run(run_sum_against_torch, scale)
    assert all(r["usable"] for r in results), "peer reads must work between sibling processes"
    assert all(r["ints_equal"] for r in results)
    assert len({r["digest"] for r in results}) == 1, "replicas differ"
    for r in results:
        if world_size == 2:  # two addends: x + y == y + x, so torch's bits exactly
            assert r["floats_equal"], r["worst"]
        else:
            assert r["worst"] < 1e-5


def run_probe_with_one_rank_off(world):
    from ddpkit.comm.shm import ShmCommunicator
    from ddpkit.comm.shm.peer_sum import PeerSum

    if world.rank == 1:
        os.environ[peer_read.ENV] = "0"
    try:
        comm = ShmCommunicator()
        usable = PeerSum(comm, 4).usable
        comm.close()
    finally:
        os.environ.pop(peer_read.ENV, None)
    return usable


def test_one_rank_without_peer_reads_turns_them_off_everywhere(pools):
    assert pools(3).run(run_probe_with_one_rank_off) == [False, False, False]


def run_layout_mismatch(world):
    from ddpkit.comm.shm import ShmCommunicator
    from ddpkit.comm.shm.peer_sum import PeerSum

    comm = ShmCommunicator()
    summer = PeerSum(comm, 4)
    # the same total size, cut differently on rank 1
    shapes = [(6,), (4,)] if world.rank == 1 else [(4,), (6,)]
    try:
        summer.sum_([torch.ones(s) for s in shapes])
        error = None
    except CommError as exc:
        error = str(exc)
    after = [torch.full((5,), float(world.rank + 1)), torch.ones(3)]
    summer.sum_(after)  # the communicator stays usable
    comm.close()
    return error, [t.tolist() for t in after]


def test_layout_mismatch_is_the_same_error_on_every_rank(pools):
    results = pools(2).run(run_layout_mismatch)
    errors = {e for e, _ in results}
    assert len(errors) == 1 and None not in errors, errors
    assert "differ across ranks" in errors.pop()
    for _, after in results:
        assert after == [[3.0] * 5, [2.0] * 3]


def test_span_pairs_cut_both_lists_at_every_boundary():
    pairs = peer_read._paired([(100, 10)], [(0, 3), (50, 7)])
    assert pairs == [(100, 0, 3), (103, 50, 7)]
    pairs = peer_read._paired([(0, 4), (10, 4)], [(200, 2), (300, 6)])
    assert pairs == [(0, 200, 2), (2, 300, 2), (10, 302, 4)]


def test_reading_from_a_process_that_is_gone_raises():
    buf = torch.zeros(2)
    with pytest.raises(OSError):
        # pid 2**22 + 1 is above the kernel's pid_max default: no such process
        peer_read.read(2**22 + 1, [(buf.data_ptr(), 8)], [(buf.data_ptr(), 8)])
