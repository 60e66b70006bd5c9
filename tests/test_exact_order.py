"""Exact mode's same bits with terms whose sum depends on the order of the additions.

Per-slice gradients of ordinary models lie within a few powers of two of each other,
so a float64 sum of them is exact in any order, and a sum laid out rank by rank (an
order that depends on W) would pass a test on them. Here a planted parameter gets, per
element, the terms 1, -1 and 2^-60 from three slices (zeros from the others), beside a
layer with random gradients: added in another order, 1 + 2^-60 rounds to 1 and the
element's sum changes from 2^-60 to 0. The test checks that it does for the orders a
rank-by-rank layout gives at W = 2, 3, 4, then that every sum format, on every
transport, at W = 1..4 and across a resume at another world size, ends with W = 1's
bits. ``tests/mutations.py`` plants the rank-by-rank order in the gather tree
("exact-gather-adds-rank-by-rank") and expects these tests to fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_exact import _restoring, _same, _with_sum_format

V = 12  # slices: W = 1, 2, 3, 4 all divide it
ROWS = 2 * V  # the global batch: slice k holds rows k and k + V
PLANTED = 48  # elements of the planted parameter
TINY = 2.0 ** -60


def _planted_terms(step: int) -> torch.Tensor:
    """``[V, PLANTED]``: per element, +-1, -+1 and +-2^-60 in three distinct slices."""
    g = torch.Generator().manual_seed(100 + step)
    terms = torch.zeros(V, PLANTED)
    for j in range(PLANTED):
        a, b, c = torch.randperm(V, generator=g)[:3].tolist()
        sign = 1.0 if torch.rand(1, generator=g).item() < 0.5 else -1.0
        terms[a, j], terms[b, j] = sign, -sign
        terms[c, j] = TINY * (1.0 if torch.rand(1, generator=g).item() < 0.5 else -1.0)
    return terms


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``k`` carry slice k's planted terms (rows ``k + V``: zeros there), so a
    slice's planted gradient is its term exactly; the other columns are random."""
    g = torch.Generator().manual_seed(step)
    x = torch.cat([torch.randn(ROWS, 12, generator=g), torch.zeros(ROWS, PLANTED)], dim=1)
    x[:V, 12:] = _planted_terms(step)
    return x, torch.randint(0, 4, (ROWS,), generator=g)


class _PlantedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 4)
        self.planted = nn.Parameter(torch.zeros(PLANTED))  # its gradient: the planted terms

    def forward(self, x):
        return self.fc(x[:, :12]), (x[:, 12:] * self.planted).sum()


def _planted_loop(world, comm: str, first: int = 0, steps: int = 3, state=None):
    """Steps ``first`` .. ``first + steps - 1`` of an SGD loop on the planted model (from
    ``state``, a resume, if given); the parameters and what a resume needs."""
    import ddpkit

    torch.manual_seed(0)
    model = ddpkit.DataParallel(_PlantedNet(), exact=True, slices=V, comm=comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        model.exact.load_state_dict(state["exact"])
    r, w = world.rank, world.world_size
    for step in range(first, first + steps):
        x, y = _global_batch(step)
        opt.zero_grad()
        for xs, ys in model.slices(x[r::w], y[r::w]):  # ShardSampler's positions
            out, planted = model(xs)
            (F.cross_entropy(out, ys) + planted).backward()
        opt.step()
    return {"params": [p.detach().clone() for p in model.module.parameters()],
            "model": model.module.state_dict(), "optimizer": opt.state_dict(),
            "exact": model.exact.state_dict()}


def _pairwise(rows: torch.Tensor) -> torch.Tensor:
    """The gather format's tree over ``rows`` in float64: 2i + (2i + 1), odd last carried."""
    rows = rows.double()
    while len(rows) > 1:
        pairs = rows[0:len(rows) // 2 * 2:2] + rows[1:len(rows) // 2 * 2:2]
        rows = torch.cat([pairs, rows[len(rows) // 2 * 2:]])
    return rows[0]


def test_the_planted_terms_sum_to_other_bits_in_a_rank_by_rank_order():
    """Without this the tests below could not tell a W-dependent order from the right one."""
    for step in range(3):
        terms = _planted_terms(step)
        in_slice_order = _pairwise(terms)
        for w in (2, 3, 4):
            rank_by_rank = torch.cat([terms[r::w] for r in range(w)])  # rank r: r, r + w, ...
            assert not torch.equal(_pairwise(rank_by_rank), in_slice_order), (step, w)
            in_place_sum = torch.zeros(PLANTED, dtype=torch.float64)
            for r in range(w):  # each rank's partial sum, then the ranks' in turn
                in_place_sum += _pairwise(terms[r::w])
            assert not torch.equal(in_place_sum, in_slice_order), (step, w)


@pytest.fixture(scope="module")
def one_process(pools):
    """W = 1 per sum format: the reference every layout must reproduce."""
    return {fmt: pools(1).run(_restoring, _with_sum_format, fmt, _planted_loop, "auto")[0]
            for fmt in ("int32", "float64", "gather", "fold")}


def test_the_reference_keeps_the_tiny_terms_where_the_format_can(one_process):
    """The float64-tree formats keep 2^-60 (the planted parameter moves); the formats
    differ, so each test below compares a format with itself."""
    for fmt in ("gather", "fold"):
        assert one_process[fmt]["params"][2].abs().max() > 0, fmt
    assert not _same(one_process["gather"]["params"], one_process["int32"]["params"])


@pytest.mark.parametrize("comm", ["ring", "shm", "backend"])
@pytest.mark.parametrize("sum_format", ["int32", "float64", "gather", "fold"])
def test_every_format_and_transport_ends_with_one_process_bits(pools, one_process,
                                                               sum_format, comm):
    for w in (2, 3, 4):
        for r in pools(w).run(_restoring, _with_sum_format, sum_format, _planted_loop, comm):
            assert _same(r["params"], one_process[sum_format]["params"]), (w, r["exact"])


@pytest.mark.parametrize("sum_format", ["int32", "float64", "gather", "fold"])
def test_stopped_at_one_world_size_and_continued_at_another_ends_with_the_same_bits(
        pools, sum_format):
    args = (_restoring, _with_sum_format, sum_format, _planted_loop, "auto")
    (full,) = pools(1).run(*args, 0, 4)
    for first, second in ((2, 3), (4, 1), (3, 2)):
        stopped = pools(first).run(*args, 0, 2)[0]
        resumed = pools(second).run(*args, 2, 2, stopped)
        for r in resumed:
            assert _same(r["params"], full["params"]), (first, second)
