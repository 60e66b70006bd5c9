"""The shard cut (pure): every rank's chunks partition each bucket, the pieces say which
part of which parameter a chunk holds, and the cut is the shm all-reduce's own."""

import torch

from ddpkit.comm import chunk_bounds
from ddpkit.parallel.engine.buckets import assign_buckets, build_buckets
from ddpkit.parallel.zero.shard_layout import Piece, bucket_shards, pieces_in


def test_pieces_cover_exactly_the_chunk():
    # parameters of 5, 300 and 7 elements at offsets 0, 5, 305 of one bucket
    found = pieces_in([0, 1, 2], [0, 5, 305], [5, 300, 7], 3, 310)
    assert found == [Piece(0, 3, 5, 0), Piece(1, 0, 300, 2), Piece(2, 0, 5, 302)]
    assert sum(p.stop - p.start for p in found) == 310 - 3
    assert pieces_in([0], [0], [5], 5, 5) == []  # an empty chunk holds nothing


def test_every_world_size_partitions_every_bucket_like_the_all_reduce():
    params = [torch.zeros(n) for n in (7, 1000, 33, 4096, 1)]
    buckets = build_buckets(params, assign_buckets(params, [4, 3, 2, 1, 0], [4096, 8192]))
    for world in (1, 2, 3, 4, 7):
        layouts = [bucket_shards(buckets, params, r, world) for r in range(world)]
        for b, bucket in enumerate(buckets):
            cut = [layouts[r][b] for r in range(world)]
            assert list(cut[0].bounds) == chunk_bounds(bucket.numel, 4, world)
            assert [c.lo for c in cut] == sorted(c.lo for c in cut)
            assert cut[0].lo == 0 and cut[-1].hi == bucket.numel
            assert all(a.hi == b.lo for a, b in zip(cut, cut[1:]))
            # every element of every parameter of the bucket is in exactly one piece
            seen = {i: torch.zeros(params[i].numel()) for i in bucket.param_indices}
            for c in cut:
                for p in c.pieces:
                    seen[p.param][p.start:p.stop] += 1
                    assert p.at >= 0 and p.at + p.stop - p.start <= c.hi - c.lo
            assert all(bool((s == 1).all()) for s in seen.values())
