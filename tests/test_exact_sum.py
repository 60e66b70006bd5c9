"""Exact mode's arithmetic, in one process: the reproducible mean, slices,
slice random streams.

The mean is checked against the float64 mean of the same float32 terms: within its
documented bound, never further off than float32 summation, and the same bits for
every grouping of the terms into "ranks" and every order of adding their partial sums.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ddpkit.data.partition import ShardSampler
from ddpkit.errors import ConfigError
from ddpkit.parallel.exact.exact_gather import fold_levels
from ddpkit.parallel.exact.exact_sum import fixed_point_bits
from ddpkit.parallel.exact.exact_sum32 import (
    FORMAT_ENV,
    GATHER_ELEMENTS,
    INT32_MAX_TERMS,
    SMALL_SUM_ELEMENTS,
    choose_format,
    int32_bits,
    make_mean,
)
from ddpkit.parallel.exact.slices import owned_slices, slice_positions, slice_rng, slice_seed
from ddpkit.slice_count import check_slices, default_slices, world_sizes


@pytest.fixture(params=["int32", "float64"])
def fmt(request) -> str:
    """Each test of the mean runs on both formats of the sum."""
    return request.param


def _bits_of_format(fmt: str, v: int) -> int:
    return int32_bits(v) if fmt == "int32" else fixed_point_bits(v)


def _terms(v: int, n: int, seed: int = 0) -> torch.Tensor:
    """Float32 terms over 74 decades, with the awkward values planted."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(v, n, generator=g) * torch.logspace(-44, 30, n)
    x[:, 0] = 0.0
    x[:, 1] = -0.0
    x[0, 2] = 1e-45  # float32's smallest subnormal
    x[:, 3] = 3e38  # the float32 sum overflows; the mean does not
    x[:, 4] = torch.tensor([1.0, -1.0] * (v // 2) + [0.0] * (v % 2))  # cancels exactly
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _grouped_mean(fmt, terms, groups: list[list[int]], order: list[int], *,
                  segments: list[int] | None = None) -> torch.Tensor:
    """The mean computed as ranks would: each group is one rank's rows; the MAX and SUM
    all-reduces are done here, the SUM in the given order of groups. ``terms``: a
    ``[V, n]`` tensor, or (with ``segments``) a list of rows of per-segment tensors."""
    if segments is None:
        v, n = terms.shape
    else:
        v, n = len(terms), sum(segments)
    ranks = [make_mean(fmt, len(g), n, v, segments=segments) for g in groups]

    def rows(group):  # per segment: the group's terms (the first segment stacked)
        if segments is None:
            return terms[group]
        columns = [[terms[k][j] for k in group if terms[k][j] is not None]
                   for j in range(len(segments))]
        columns[0] = torch.stack(columns[0]) if columns[0] else torch.empty(0, segments[0])
        return columns

    for mean, group in zip(ranks, groups, strict=True):
        mean.local_max(rows(group))
    agreed = torch.stack([m.maxima for m in ranks]).amax(0)
    for mean in ranks:
        mean.maxima.copy_(agreed)
    partial = [m.encode(rows(g)).clone() for m, g in zip(ranks, groups, strict=True)]
    total = partial[order[0]].clone()
    for i in order[1:]:
        total += partial[i]
    ranks[0].total.copy_(total)
    return ranks[0].decode(torch.empty(n))


@pytest.mark.parametrize("v", [1, 2, 3, 12, INT32_MAX_TERMS])
def test_mean_is_within_its_bound_and_never_worse_than_float32(fmt, v):
    terms = _terms(v, 8_000, seed=v)
    got = make_mean(fmt, v, terms.shape[1], v).mean(terms, torch.empty(terms.shape[1])).double()
    exact = terms.double().sum(0) / v
    plain = (terms.sum(0) / v).double()
    finite = torch.isfinite(exact)
    err, plain_err = (got - exact).abs()[finite], (plain - exact).abs()[finite]
    bound = ((2.0**-24 + 2.0**-53) * exact.abs() + 2.0**-_bits_of_format(fmt, v)
             * terms.double().abs().amax(0) + 2.0**-150)[finite]
    assert (err <= bound).all()
    # never worse than float32 summation's own bound (u |g| + (V - 1) u sum_k |g_k| / V)
    float32_bound = (2.0**-24 * (exact.abs() + (v - 1) * terms.double().abs().sum(0) / v)
                     + 2.0**-150)[finite]
    assert (err <= float32_bound).all()
    if fmt == "float64":  # its terms round 2^28 times finer than a float32 sum: better
        assert (err <= plain_err).all()  # on every element (not a promise of int32's)
    assert got[3] == terms[0, 3]  # no overflow in the sum (float32's does, from 2 terms)
    assert torch.isinf(plain[3]) == (v > 1)
    assert got[4] == exact[4]
    if v == 1:  # one term: the term itself (with -0 as +0, as every zero sum is)
        assert torch.equal(_bits(got.float()), _bits(terms[0] + 0.0))


def test_same_bits_for_every_grouping_and_order(fmt):
    v = 12
    terms = _terms(v, 4_000, seed=5)
    reference = _bits(make_mean(fmt, v,  terms.shape[1], v).mean(terms, torch.empty(4_000)))
    rng = random.Random(1)
    for world in (2, 3, 4, 6, 12):
        slices = list(range(v))
        rng.shuffle(slices)
        groups = [slices[r::world] for r in range(world)]
        order = rng.sample(range(world), world)
        assert torch.equal(_bits(_grouped_mean(fmt, terms, groups, order)), reference), world
    # The plain float32 sum of the same rows does depend on the grouping.
    a = terms[:6].sum(0) + terms[6:].sum(0)
    b = terms[0::2].sum(0) + terms[1::2].sum(0)
    assert not torch.equal(a, b)


def test_rows_of_per_parameter_gradients_give_the_bits_of_one_tensor(fmt):
    """A slice's gradients summed where autograd left them (one tensor per parameter,
    missing for a parameter the slice did not use) or stacked give the bits of the same
    terms copied into rows with zeros, for every grouping; segments span several
    pieces."""
    v, segments = 8, [5, 70_001, 1, 3_000]
    terms = _terms(v, sum(segments), seed=3)
    unused = {(1, 0), (2, 2), (5, 0), (6, 3)} | {(k, 2) for k in range(v) if k != 2}
    rows = []
    for k in range(v):
        row = list(terms[k].split(segments))
        for j in range(len(segments)):
            if (k, j) in unused:
                row[j].zero_()
                row[j] = None
        rows.append(row)
    n = sum(segments)
    reference = _bits(make_mean(fmt, v, n, v).mean(terms, torch.empty(n)))
    got = _grouped_mean(fmt, rows, [list(range(v))], [0], segments=segments)
    assert torch.equal(_bits(got), reference)
    for groups, order in (([[0, 3, 5, 6], [1, 2, 4, 7]], [1, 0]),
                          ([[7, 1], [0, 6], [3, 4], [2, 5]], [2, 0, 3, 1])):
        assert torch.equal(_bits(_grouped_mean(fmt, rows, groups, order, segments=segments)),
                           reference), groups
    # A rank none of whose rows has a segment contributes zeros to its max, whatever
    # the instance held before.
    mean = make_mean(fmt, 2, n, v, segments=segments)
    mean.local_max([list(c) for c in (terms[:2] * 1e30).split(segments, dim=1)])
    start = sum(segments[:2])
    mine = [[rows[k][j] for k in (0, 3) if rows[k][j] is not None]
            for j in range(len(segments))]
    assert (mean.local_max(mine)[start:start + segments[2]] == 0).all()


def test_non_finite_terms_give_the_same_non_finite_result_everywhere(fmt):
    v = 4
    terms = torch.ones(v, 6)
    terms[1, 0] = float("inf")
    terms[2, 1] = float("nan")
    terms[0, 2], terms[3, 2] = float("inf"), float("-inf")
    terms[1:, 4] = float("-inf")
    terms[0, 5] = -3e38
    one = make_mean(fmt, v, 6, v).mean(terms, torch.empty(6))
    two = _grouped_mean(fmt, terms, [[3, 1], [0, 2]], [1, 0])
    assert torch.isinf(one[0]) and one[0] > 0
    assert torch.isnan(one[1]) and torch.isnan(one[2])
    assert one[3] == 1.0
    assert torch.isinf(one[4]) and one[4] < 0
    assert one[5] == torch.tensor(-3e38 + 3.0).float() / v
    assert torch.equal(_bits(one), _bits(two))


def test_extra_values_ride_along_in_the_max(fmt):
    terms = torch.randn(2, 10)
    mean = make_mean(fmt, 2, 10, 4, extra=3)
    flags = torch.tensor([0.0, 1.0, 0.0])

    def others_used_the_first(t):  # another rank: parameter 0 used there
        t[-3] = torch.maximum(t[-3], torch.tensor(1.0))

    mean.mean(terms, torch.empty(10), all_reduce_max=others_used_the_first, extra_max=flags)
    assert flags.tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("fmt", ["gather", "fold"])
@pytest.mark.parametrize("v", [1, 2, 3, 12, 100])
def test_gather_mean_is_within_its_bound_and_never_worse_than_float32(v, fmt):
    """The gather and fold formats: float64 additions in a tree over the slices, then one
    division."""
    terms = _terms(v, 8_000, seed=v)
    got = make_mean(fmt, v, terms.shape[1], v).mean(terms, torch.empty(8_000)).double()
    exact = terms.double().sum(0) / v
    plain = (terms.sum(0) / v).double()
    finite = torch.isfinite(exact)
    err = (got - exact).abs()[finite]
    total = terms.double().abs().sum(0)
    # twice the additions' part: the float64 reference rounds its additions as much
    bound = ((2.0**-24 + 2.0**-52) * exact.abs() + 2.02 * (v - 1) * 2.0**-53 * total / v
             + 2.0**-150)[finite]
    assert (err <= bound).all()
    float32_bound = (2.0**-24 * (exact.abs() + (v - 1) * total / v) + 2.0**-150)[finite]
    assert (err <= float32_bound).all()
    assert got[3] == terms[0, 3] and got[4] == exact[4]
    assert torch.isinf(plain[3]) == (v > 1)  # float32's sum overflows there; float64's not
    if v == 1:  # one term: the term itself, bit for bit
        assert torch.equal(_bits(got.float()), _bits(terms[0]))


def _run_ranks(rank, world: int) -> None:
    """``rank(r)`` for every r of ``world``, each in its own thread, all at once."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _gathered_means(terms: torch.Tensor, world: int, extras: list[torch.Tensor] | None = None,
                    fmt: str = "gather"):
    """Each of ``world`` ranks' gather (or fold) mean of ``terms`` (``[V, n]``), rank r
    holding the slices r, r + W, ... as exact mode lays them out: one thread per rank,
    the all-gather done here (each rank's message, once every rank has given its own)."""
    v, n = terms.shape
    extra = 0 if extras is None else len(extras[0])
    sent: list[torch.Tensor | None] = [None] * world
    everyone = threading.Barrier(world)
    results: list = [None] * world

    def rank(r: int) -> None:
        mean = make_mean(fmt, v // world, n, v, extra=extra)
        mean.rows_view.copy_(terms[list(owned_slices(r, world, v))])

        def gather(out, inp):
            sent[r] = inp.clone()
            everyone.wait()
            out.copy_(torch.cat(sent))

        flags = None if extras is None else extras[r].clone()
        got = mean.mean(mean.rows_view, torch.empty(n), all_gather=gather, extra_max=flags)
        results[r] = (got, flags)

    _run_ranks(rank, world)
    return results


@pytest.mark.parametrize("fmt", ["gather", "fold"])
def test_gather_mean_has_the_same_bits_at_every_world_size(fmt):
    """Every rank of every W that divides V ends with the bits one process gets (a
    fixed order of additions, by slice), and the extras hold their maximum."""
    v = 12
    terms = _terms(v, 4_000, seed=5)
    terms[:, 5:9] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0])
    terms[3, 8] = float("inf")
    reference = _bits(make_mean(fmt, v, 4_000, v).mean(terms, torch.empty(4_000)))
    for world in (1, 2, 3, 4, 6, 12):
        extras = [torch.tensor([float(r == 1), 0.0]) for r in range(world)]
        for got, flags in _gathered_means(terms, world, extras, fmt):
            assert torch.equal(_bits(got), reference), world
            assert flags.tolist() == [float(world > 1), 0.0]
    # The order is what makes it so: adding the same rows in rank order instead differs.
    by_rank = torch.cat([terms[r::2] for r in range(2)]).double()
    assert not torch.equal(_bits((by_rank.cumsum(0)[-1] / v).float()), reference)


def _means_read_in_place(steps: list[torch.Tensor], world: int, fmt: str,
                         extras: list[torch.Tensor]):
    """Per step of ``steps`` (each ``[V, n]``), each of ``world`` ranks' mean when the
    ranks read each other's messages in place (as on one host's shared segment): one
    thread per rank, one builder each, a step's sum after the other's."""
    v, n = steps[0].shape
    allocated: list[list[torch.Tensor]] = [[] for _ in range(world)]
    everyone = threading.Barrier(world)
    results: list = [[None] * world for _ in steps]

    class Shared:  # the transport's two calls the in-place sum makes
        def __init__(self, r: int):
            self.r = r

        def peer_views(self, tensors):
            everyone.wait()  # every rank has allocated its copies
            mine = [t.data_ptr() for t in allocated[self.r]]
            return [[allocated[q][mine.index(t.data_ptr())] for q in range(world)]
                    for t in tensors]

        def barrier(self):
            everyone.wait()

    def rank(r: int) -> None:
        def allocate(numel, dtype, device):  # stale values: every copy is written first
            allocated[r].append(torch.full((numel,), float(r + 3), dtype=dtype))
            return allocated[r][-1]

        mean = make_mean(fmt, v // world, n, v, extra=len(extras[0]), allocate=allocate)
        for i, terms in enumerate(steps):
            mean.rows_view.copy_(terms[list(owned_slices(r, world, v))])
            flags = extras[r].clone()
            got = mean.mean(mean.rows_view, torch.empty(n), extra_max=flags, shared=Shared(r),
                            all_gather=None)
            results[i][r] = (got.clone(), flags)

    _run_ranks(rank, world)
    return results


@pytest.mark.parametrize("fmt", ["gather", "fold"])
def test_messages_read_in_place_give_the_gathers_bits(fmt):
    """On one host the ranks read each other's messages where they lie, two copies used
    in turn: every step's mean has the bits of one process, the extras their maximum."""
    v = 12
    steps = [_terms(v, 1_000, seed=s) for s in (6, 7, 8)]
    steps[1][:, 5:9] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    references = [_bits(make_mean(fmt, v, 1_000, v).mean(t, torch.empty(1_000))) for t in steps]
    for world in (2, 3, 4, 12):
        extras = [torch.tensor([float(r == 1), 0.0]) for r in range(world)]
        for reference, ranks in zip(references, _means_read_in_place(steps, world, fmt, extras),
                                    strict=True):
            for got, flags in ranks:
                assert torch.equal(_bits(got), reference), world
                assert flags.tolist() == [1.0, 0.0]


def test_fold_and_gather_are_different_trees():
    """The two formats add in different orders (so a run keeps the one it began with):
    on these four terms gather's (0 + 1) + (2 + 3) is exact and rounds up to float32,
    fold's (0 + 2) + (1 + 3) rounds twice to even in float64 and lands on the tie."""
    terms = torch.tensor([[1.0], [2.0**-24], [2.0**-53], [2.0**-53]])
    gather = make_mean("gather", 4, 1, 4).mean(terms, torch.empty(1))
    fold = make_mean("fold", 4, 1, 4).mean(terms, torch.empty(1))
    assert gather.item() == 0.25 * (1 + 2.0**-23) and fold.item() == 0.25
    assert fold_levels(12) == [(12, 6), (6, 3), (3, 2), (2, 1)] and fold_levels(1) == []


def test_gather_mean_wants_every_row_in_its_place():
    mean = make_mean("gather", 2, 10, 4, segments=[4, 6])
    with pytest.raises(ValueError, match="give all 2 local rows"):
        mean.mean([torch.ones(2, 4), [torch.ones(6)]], torch.empty(10),
                  all_gather=lambda out, inp: None)
    with pytest.raises(ValueError, match="same row count on every rank"):
        make_mean("gather", 3, 10, 4)


def test_the_int32_format_serves_up_to_63_slices_and_float64_above(monkeypatch):
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    big = max(SMALL_SUM_ELEMENTS, GATHER_ELEMENTS)  # above the gather format's V * n
    assert [int32_bits(v) for v in (1, 2, 3, 4, 8, 12, 63)] == [30, 29, 29, 28, 27, 27, 25]
    assert choose_format(63, numel=big) == "int32"
    assert choose_format(64, numel=big) == "float64"
    assert choose_format(12, "float64", numel=big) == "float64"
    with pytest.raises(ConfigError, match="at most 63 slices.*DDPKIT_EXACT_SUM=float64"):
        choose_format(64, "int32", numel=big)
    with pytest.raises(ConfigError, match="one of int32, float64, gather, fold"):
        choose_format(8, "int16", numel=big)


def test_small_models_sum_in_fold_or_float64_by_default_at_every_world_size(pools,
                                                                           monkeypatch):
    """Up to GATHER_ELEMENTS elements in V rows the default is the fold format, else
    below SMALL_SUM_ELEMENTS trainable elements float64, from the element count and V
    alone: an engine at W = 1 and at W = 2 picks the same (the main job's MLP is small,
    the 8.4M benchmark MLP is not); asked for, int32 still serves a small model."""
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    assert choose_format(8, numel=GATHER_ELEMENTS // 8) == "fold"
    assert choose_format(32, numel=GATHER_ELEMENTS // 32 + 1) == "float64"
    assert choose_format(64, numel=GATHER_ELEMENTS // 64) == "fold"  # any V
    assert choose_format(32, numel=SMALL_SUM_ELEMENTS - 1) == "float64"
    assert choose_format(32, numel=SMALL_SUM_ELEMENTS) == "int32"
    assert choose_format(8, "int32", numel=10) == "int32"
    for world in (1, 2):
        picked = pools(world).run(_engine_formats)
        assert picked == [{"small": "fold", "large": "int32", "small32": "float64"}] * world, \
            (world, picked)


def _engine_formats(world):
    import ddpkit
    from ddpkit.train.models import MLP

    small = MLP(64, 10, (128,))  # the main job's model
    large = torch.nn.Linear(128, SMALL_SUM_ELEMENTS // 128)
    picked = {}
    try:
        for name, module, v in (("small", small, 4), ("large", large, 16),
                                ("small32", small, 32)):
            model = ddpkit.DataParallel(module, exact=True, slices=v)
            picked[name] = model.exact.sum_format
            model.transport.close()
    finally:  # the process-wide settings exact mode pins, put back for later tests
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(1)
    return picked
    # 63 terms of the largest integer P allows, any order, stay inside int32
    assert INT32_MAX_TERMS * 2**int32_bits(INT32_MAX_TERMS) < 2**31
    mean = make_mean("int32", 63, 4, 63)
    terms = torch.full((63, 4), -1.999999)  # just below 2^e: about -2^P each
    q = round(float(terms[0, 0]) * 2**24)  # its grid: 2^(e - P) = 2^-24
    assert 2**25 - 64 < -q < 2**25
    got = mean.mean(terms, torch.empty(4))
    assert (mean.total == 63 * q).all() and torch.equal(got, terms[0])


def test_default_slices_serve_the_most_world_sizes():
    assert default_slices(96) == 12
    assert world_sizes(12) == [1, 2, 3, 4, 6, 12]
    assert default_slices(128) == 8
    assert default_slices(100) == 10
    assert default_slices(300) == 12
    assert default_slices(7) == 7
    assert fixed_point_bits(12) == 49 and fixed_point_bits(1) == 53


@pytest.mark.parametrize(("v", "batch", "world", "message"), [
    (5, 96, None, "5 slices do not divide the global batch of 96; use a divisor of "
                  "it (e.g. 12)"),
    (12, 96, 5, "exact mode with 12 slices runs on 1, 2, 3, 4, 6, 12 processes, "
                "not 5"),
    (0, 96, 2, "slices must be a positive integer, got 0"),
])
def test_slice_mistakes_are_one_line(v, batch, world, message):
    with pytest.raises(ConfigError) as err:
        check_slices(v, batch, world)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("drop_last", [False, True])
def test_each_slice_holds_the_same_samples_at_every_world_size(drop_last):
    """Over two epochs of a batch that does not divide the data (a padded last batch),
    slice k of every step holds the same samples in the same order for W = 1..4."""
    v, batch, n = 12, 96, 250

    def slices_by_step(world):
        out = {}
        for rank in range(world):
            sampler = ShardSampler(n, global_batch_size=batch, num_replicas=world, rank=rank,
                                   seed=3, drop_last=drop_last, slices=v)
            for step, b in enumerate(list(sampler.batches()) + list(sampler.batches())):
                parts = slice_positions(len(b.indices), v, world)
                for k, part in zip(owned_slices(rank, world, v), parts, strict=True):
                    mine = b.indices[part]
                    real = len([j for j in range(len(b.indices))[part] if j < b.num_real])
                    out[(step, k)] = (mine, real, b.global_num_real)
        return out

    one = slices_by_step(1)
    assert len({len(s[0]) for key, s in one.items() if key[0] == 2}) == 1  # equal slices
    for world in (2, 3, 4):
        assert slices_by_step(world) == one


def test_sampler_refuses_slices_that_do_not_fit():
    with pytest.raises(ConfigError, match="must divide the global batch"):
        ShardSampler(100, global_batch_size=96, num_replicas=2, rank=0, slices=5)
    with pytest.raises(ConfigError, match="multiple of the world size"):
        ShardSampler(100, global_batch_size=96, num_replicas=8, rank=0, slices=12)


def test_a_local_batch_that_does_not_cut_into_its_slices_is_one_line():
    with pytest.raises(ConfigError, match=r"ShardSampler\(\.\.\., slices=12\)"):
        slice_positions(25, 12, 2)


def test_slice_streams_depend_on_seed_step_and_slice_only():
    seeds = {slice_seed(s, t, k) for s in range(3) for t in range(5) for k in range(12)}
    assert len(seeds) == 3 * 5 * 12
    torch.manual_seed(99)
    before = torch.get_rng_state()
    with slice_rng(1, 2, 3) as seed:
        first = torch.rand(5)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is untouched
    torch.rand(7)  # whatever the caller drew meanwhile
    with slice_rng(1, 2, 3):
        again = torch.rand(5)
    with slice_rng(1, 2, 4):
        other = torch.rand(5)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert seed == slice_seed(1, 2, 3)
