"""The "gather" format of exact mode's sum: every slice's gradient on every rank, added
in slice order.

The "int32" and "float64" formats (:mod:`ddpkit.parallel.exact.exact_sum32`,
:mod:`ddpkit.parallel.exact.exact_sum`) make the sum independent of its grouping by
rounding every term onto an agreed grid: two all-reduces (the grid, then the
integers) and three passes over the terms. On a small model those are a fixed cost of
several Python-level calls and two collective latencies per step, larger than the
arithmetic. This format instead moves the terms themselves:

1. every rank's V/W local float32 rows (a row per slice: that slice's gradient) are
   all-gathered, so every rank holds all V rows (one collective, V·n·4 bytes);
2. every rank adds them in *global slice order* 0, 1, ..., V-1, in float64, starting
   from slice 0's row: one fixed sequence of float64 additions whatever the world size
   (the rows are the same bits at every W, see :mod:`ddpkit.parallel.exact.slices`);
3. the sum is divided by V in float64 (one rounding) and cast to the gradient's dtype.

Rank r's local row m is global slice ``r + m·W`` (:func:`owned_slices`), so after a
gather in rank order slice k sits in block ``k % W``, row ``k // W``. At W = 1 nothing
is gathered and the same additions run on the local rows.

Accuracy: a float32 term is exact in float64; each of the V - 1 additions rounds at
``2^-53`` of its partial sum, so with ``g`` the true mean, per element (to first order)
``|r - g| <= u |g| + 2^-53 |g| + (V - 1) 2^-53 sum_k |g_k| / V`` (u = 2^-24: the cast;
the division; the additions). Float32 summation then division is bounded by
``u |g| + (V - 1) u sum_k |g_k| / V``: the additions' part is 2^29 times smaller here,
and ``2^-53 |g| <= 2^-53 sum_k |g_k| / V``, so the bound holds for every V; no V is too
large for the arithmetic. The cost grows with V·n (every rank receives and adds every
row), so exact mode picks this format by default only where V·n is small
(:func:`ddpkit.parallel.exact.exact_sum32.choose_format`). Non-finite terms come out as
float summation in that fixed order makes them (inf, or NaN), the same on every rank
and world size; zeros as float64 addition from slice 0's row makes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ddpkit.parallel.exact.exact_sum import Column, checked_segments, columns_of

Gather = Callable[[torch.Tensor, torch.Tensor], object]  # (output, input), in place


class ExactMeanGather:
    """The "gather" format of :class:`~ddpkit.parallel.exact.exact_sum.ExactMean`: the
    same constructor and ``mean``, with ``all_gather(output, input)`` (rank order, in
    place; None: this process holds every row) in place of the two all-reduces.

    ``rows_view``: the ``[rows, n]`` float32 rows the gather sends; a caller that copies
    each slice's gradient straight into its row passes ``rows_view`` itself as the
    slots, and nothing more is copied before the collective. ``rows`` must divide
    ``terms`` (every rank holds V/W rows)."""

    format = "gather"

    def __init__(self, rows: int, n: int, terms: int, *, extra: int = 0,
                 device: torch.device | str = "cpu", allocate=None,
                 segments: Sequence[int] | None = None):
        self.segments = checked_segments(rows, n, terms, segments)
        if rows < 1 or terms % rows:
            raise ValueError(f"the gather sum needs the same row count on every rank: "
                             f"{rows} rows of {terms} terms")
        self.rows, self.n, self.terms, self.extra = rows, n, terms, extra
        self.world = terms // rows
        self._width = rows * n + extra  # one rank's message: its rows, then its extras
        self._local = torch.zeros(self._width, dtype=torch.float32, device=device)
        self.rows_view = self._local[: rows * n].view(rows, n)
        self._gathered = (torch.empty(self.world * self._width, dtype=torch.float32,
                                      device=device) if self.world > 1 else None)
        self._acc = torch.empty(n, dtype=torch.float64, device=device)
        # global slice k -> (block, row): rank k % W's row k // W
        self._order = [(k % self.world, k // self.world) for k in range(terms)]

    def mean(self, slots: torch.Tensor | Sequence[Column], out: torch.Tensor, *,
             all_gather: Gather | None = None, extra_max: torch.Tensor | None = None,
             **_unused) -> torch.Tensor:
        """``out`` (any float dtype, n elements) = the mean over all terms.

        ``extra_max``: ``extra`` values (per-parameter "used" flags) whose maximum over
        the ranks it holds afterwards (they travel in the same gather)."""
        self._fill(slots)
        if self.extra:
            self._local[self.rows * self.n:].copy_(extra_max.reshape(-1))
        if self.world > 1:
            if all_gather is None:
                raise ValueError(f"{self.rows} local rows of {self.terms} terms need "
                                 "all_gather")
            all_gather(self._gathered, self._local)
            blocks = self._gathered.view(self.world, self._width)
        else:
            blocks = self._local.view(1, self._width)
        if self.extra:
            extra_max.copy_(blocks[:, self.rows * self.n:].amax(0).view_as(extra_max))
        return self.add(blocks, out)

    def add(self, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` = the mean of the gathered rows (``blocks``: ``[W, rows * n + extra]``
        in rank order), added in slice order in float64."""
        terms = blocks[:, : self.rows * self.n].view(self.world, self.rows, self.n)
        acc = self._acc
        first, *rest = self._order
        acc.copy_(terms[first])  # float32 -> float64: exact
        for block, row in rest:
            acc.add_(terms[block, row])  # in float64, in slice order
        acc.div_(self.terms)  # the one rounding division
        out = out.view(-1)
        out.copy_(acc)
        return out

    def _fill(self, slots: torch.Tensor | Sequence[Column]) -> None:
        """The local rows into ``rows_view``, unless they are there already."""
        if isinstance(slots, torch.Tensor) and slots.data_ptr() == self.rows_view.data_ptr():
            return
        columns = columns_of(slots, self.rows, self.n, self.segments)
        a = 0
        for size, column in zip(self.segments, columns, strict=True):
            b = a + size
            target = self.rows_view[:, a:b]
            if isinstance(column, torch.Tensor) and column.data_ptr() == target.data_ptr() \
                    and column.shape == target.shape and column.stride() == target.stride():
                a = b
                continue
            if len(column) != self.rows:  # positions are slices: none may be left out
                raise ValueError(f"the gather sum adds rows in slice order: give all "
                                 f"{self.rows} local rows of each segment (zeros for a "
                                 f"missing term), got {len(column)}")
            for m in range(self.rows):
                target[m].copy_(column[m].reshape(-1))
            a = b


__all__ = ["ExactMeanGather", "Gather"]
