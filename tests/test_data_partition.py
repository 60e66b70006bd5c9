"""DataPartitioner and ShardSampler: pure logic, no processes."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpkit.data import DataPartitioner, ShardSampler
from ddpkit.errors import ConfigError


def shards(n, world, batch, *, epoch=None, seed=0, drop_last=False):
    """One epoch of batches for every rank: {rank: [ShardBatch, ...]}."""
    out = {}
    for r in range(world):
        s = ShardSampler(n, global_batch_size=batch, num_replicas=world, rank=r, seed=seed,
                         drop_last=drop_last)
        if epoch is not None:
            s.set_epoch(epoch)
        out[r] = list(s.batches())
    return out


def real_ids(batches):
    return [i for b in batches for i in b.indices[: b.num_real]]


# --------------------------------------------------------------------------- partitioner
def test_partitioner_matches_the_tutorial():
    data = list(range(100))
    part = DataPartitioner(data, [0.5, 0.3, 0.2], seed=1234)
    expected = list(range(100))
    random.Random(1234).shuffle(expected)  # the tutorial's exact recipe
    assert part.partitions == [expected[:50], expected[50:80], expected[80:]]
    view = part.use(1)
    assert len(view) == 30 and [view[i] for i in range(30)] == expected[50:80]


def test_partitioner_equal_shards_are_disjoint():
    parts = DataPartitioner(list(range(1001)), [1 / 4] * 4, seed=7).partitions
    assert [len(p) for p in parts] == [250] * 4
    assert len(set().union(*map(set, parts))) == 1000


def test_partitioner_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="add up to"):
        DataPartitioner(list(range(10)), [0.6, 0.6])
    with pytest.raises(ConfigError, match="does not exist"):
        DataPartitioner(list(range(10)), [0.5, 0.5]).use(2)


# --------------------------------------------------------------------------- sampler
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), world=st.integers(1, 5), per_rank=st.integers(1, 9),
       seed=st.integers(0, 3))
def test_shards_are_equal_disjoint_and_complete(n, world, per_rank, seed):
    batch = world * per_rank
    by_rank = shards(n, world, batch, seed=seed)
    sizes = {len([i for b in bs for i in b.indices]) for bs in by_rank.values()}
    assert len(sizes) == 1, "every rank reads the same number of samples"
    assert len({len(bs) for bs in by_rank.values()}) == 1, "and runs the same number of steps"
    real = [i for bs in by_rank.values() for i in real_ids(bs)]
    assert sorted(real) == list(range(n)), "real samples: each exactly once"
    padding = sum(len(b.indices) - b.num_real for bs in by_rank.values() for b in bs)
    assert padding == (-n) % world
    for step in zip(*by_rank.values(), strict=True):
        assert sum(b.num_real for b in step) == step[0].global_num_real
        assert all(b.global_num_real == step[0].global_num_real for b in step)


def test_global_batches_do_not_depend_on_world_size():
    n, batch = 103, 12
    one = shards(n, 1, batch)[0]
    for world in (2, 3, 4):
        by_rank = shards(n, world, batch)
        for s, ref in enumerate(one):
            got = sorted(i for r in range(world) for i in real_ids([by_rank[r][s]]))
            assert got == sorted(ref.indices)


def test_each_epoch_gets_a_new_order_without_set_epoch():
    s = ShardSampler(50, global_batch_size=10, num_replicas=2, rank=0, seed=3)
    first, second = list(s), list(s)  # finishing an epoch moves to the next
    assert s.epoch == 2
    assert first != second
    again = ShardSampler(50, global_batch_size=10, num_replicas=2, rank=0, seed=3)
    assert list(again) == first, "the order is a function of (seed, epoch)"
    other_seed = ShardSampler(50, global_batch_size=10, num_replicas=2, rank=0, seed=4)
    assert list(other_seed) != first


def test_order_mixes_seed_and_epoch():
    a = ShardSampler(64, global_batch_size=8, seed=1)
    b = ShardSampler(64, global_batch_size=8, seed=0)
    assert not (a.order(0) == b.order(1)).all()


def test_resume_at_every_offset_continues_with_the_next_sample():
    n, world, batch = 37, 2, 6
    for r in range(world):
        full = ShardSampler(n, global_batch_size=batch, num_replicas=world, rank=r, seed=5)
        reference = list(full.batches()) + list(full.batches())  # two epochs
        for cut in range(len(reference) + 1):
            s = ShardSampler(n, global_batch_size=batch, num_replicas=world, rank=r, seed=5)
            it = s.batches()
            taken = []
            while len(taken) < cut:
                try:
                    taken.append(next(it))
                except StopIteration:
                    it = s.batches()
            state = s.state_dict()
            resumed = ShardSampler(n, global_batch_size=batch, num_replicas=world, rank=r, seed=5)
            resumed.load_state_dict(state)
            rest = []
            while len(taken) + len(rest) < len(reference):
                rest += list(resumed.batches())
            assert [b.indices for b in taken + rest] == [b.indices for b in reference], cut


def test_resume_at_any_sample_offset_with_a_dataloader():
    s = ShardSampler(23, global_batch_size=4, num_replicas=1, rank=0, seed=2)
    expected = list(s)
    for cut in range(len(expected) + 1):
        s = ShardSampler(23, global_batch_size=4, num_replicas=1, rank=0, seed=2)
        it = iter(s)
        head = [next(it) for _ in range(cut)]
        resumed = ShardSampler(23, global_batch_size=4, num_replicas=1, rank=0, seed=2)
        resumed.load_state_dict(s.state_dict())
        tail = list(resumed) if cut < len(expected) else []
        assert head + tail == expected


@pytest.mark.parametrize("old_world,new_world", [(4, 2), (2, 3), (3, 1), (1, 4)])
def test_resume_across_a_world_size_change_skips_and_repeats_nothing(old_world, new_world):
    n, batch = 101, 12
    for steps_done in range(0, 9):
        old = [ShardSampler(n, global_batch_size=batch, num_replicas=old_world, rank=r, seed=9)
               for r in range(old_world)]
        seen = []
        for s in old:
            it = s.batches()
            for _ in range(steps_done):
                b = next(it)
                seen += b.indices[: b.num_real]
        states = [s.state_dict() for s in old]
        assert all(st == {**states[0], "world_size": old_world} for st in states)
        new = [ShardSampler(n, global_batch_size=batch, num_replicas=new_world, rank=r, seed=9)
               for r in range(new_world)]
        for s in new:
            s.load_state_dict(states[0])
            for b in s.batches():
                seen += b.indices[: b.num_real]
        assert sorted(seen) == list(range(n)), steps_done
        # and the rest of the epoch kept the original global order
        order = new[0].order(0).tolist()
        done = set(order[: steps_done * batch])
        assert set(seen[: len(done)]) == done


def test_global_batch_must_divide_by_world_size():
    with pytest.raises(ConfigError, match="global batch size 10 is not divisible by world size 4"):
        ShardSampler(100, global_batch_size=10, num_replicas=4, rank=0)


def test_drop_last_drops_the_incomplete_global_batch():
    by_rank = shards(50, 2, 16, drop_last=True)
    assert all(len(bs) == 3 for bs in by_rank.values())
    assert all(b.num_real == 8 == len(b.indices) for bs in by_rank.values() for b in bs)
    assert len({i for bs in by_rank.values() for i in real_ids(bs)}) == 48
    with pytest.raises(ConfigError, match="leaves nothing"):
        ShardSampler(10, global_batch_size=16, drop_last=True)


def test_state_from_other_data_is_refused():
    s = ShardSampler(100, global_batch_size=10, seed=1)
    with pytest.raises(ConfigError, match="num_samples"):
        ShardSampler(99, global_batch_size=10, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(ConfigError, match="seed"):
        ShardSampler(100, global_batch_size=10, seed=2).load_state_dict(s.state_dict())


def test_plain_sampler_works_with_a_dataloader():
    data = torch.arange(30)
    s = ShardSampler(data, global_batch_size=8, num_replicas=2, rank=1, seed=0)
    loader = torch.utils.data.DataLoader(data, sampler=s, batch_size=s.local_batch_size)
    assert len(s) == 15
    got = torch.cat(list(loader)).tolist()
    assert got == [i for b in shards(30, 2, 8)[1] for i in b.indices]
