"""The "gather" format of exact mode's sum: every slice's gradient on every rank, added
in an order fixed by the slice index.

The "int32" and "float64" formats (:mod:`ddpkit.parallel.exact.exact_sum32`,
:mod:`ddpkit.parallel.exact.exact_sum`) make the sum independent of its grouping by
rounding every term onto an agreed grid: two all-reduces (the grid, then the
integers) and three passes over the terms. On a small model those are a fixed cost of
several Python-level calls and two collective latencies per step, larger than the
arithmetic. This format instead moves the terms themselves:

1. every rank's V/W local float32 rows (a row per slice: that slice's gradient) are
   all-gathered, so every rank holds all V rows (one collective, V·n·4 bytes);
2. every rank converts them to float64 (exact) in *global slice order* 0, 1, ..., V-1
   and adds them in a fixed pairwise tree over that order (slices 2i and 2i + 1, then
   pairs of those sums, an odd last one carried up a level): the same float64
   additions whatever the world size (the rows are the same bits at every W, see
   :mod:`ddpkit.parallel.exact.slices`), a handful of whole-row operations;
3. the sum is divided by V in float64 (one rounding; exact for a power of two) and
   cast to float32.

Rank r's local row m is global slice ``r + m·W`` (:func:`owned_slices`), so after a
gather in rank order slice k sits in block ``k % W``, row ``k // W``. At W = 1 nothing
is gathered and the same additions run on the local rows.

Accuracy: a float32 term is exact in float64, and each term passes through at most
``L = ceil(log2 V)`` additions that round at ``2^-53`` of their result, so with ``g``
the true mean, per element (to first order) ``|r - g| <= u |g| + 2^-53 |g| +
L 2^-53 sum_k |g_k| / V`` (u = 2^-24: the cast; the division; the additions). Float32
summation then division is bounded by ``u |g| + (V - 1) u sum_k |g_k| / V``; since
``L <= V - 1`` the additions' part is at least 2^29 times smaller here, and ``2^-53 |g|
<= 2^-53 sum_k |g_k| / V``, so the bound holds for every V >= 2 (V = 1: the term
itself): no V is too large for the arithmetic. The cost grows with V·n (every rank
receives and adds every row), so exact mode picks this format by default only where
V·n is small (:func:`ddpkit.parallel.exact.exact_sum32.choose_format`). Non-finite
terms come out as float64 addition in that fixed tree makes them (inf, or NaN), the
same on every rank and world size.
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
        width = rows * n + extra  # one rank's message: its rows, then its extras
        self._local = torch.zeros(width, dtype=torch.float32, device=device)
        self.rows_view = self._local[: rows * n].view(rows, n)
        self._extras_out = self._local[rows * n:]
        blocks = self._local.view(1, width)
        self._gathered = None
        if self.world > 1:
            self._gathered = torch.empty(self.world * width, dtype=torch.float32,
                                         device=device)
            blocks = self._gathered.view(self.world, width)
        self._extras_in = blocks[:, rows * n:]
        # global slice k = m W + r is block r's row m: [rows, W, n] in slice order
        self._in_order = blocks[:, : rows * n].view(self.world, rows, n).transpose(0, 1)
        self._rows64 = torch.empty(terms, n, dtype=torch.float64, device=device)
        self._rows64_in = self._rows64.view(rows, self.world, n)
        self._half = torch.empty((terms + 1) // 2, n, dtype=torch.float64, device=device)
        # the mean: x / V, one rounding in float64 (exact scaling when V is a power of
        # two), then the cast; the divisor a tensor, so that no kernel (CUDA's) turns a
        # scalar division into a rounded reciprocal's product
        self._divisor = torch.tensor(float(terms), dtype=torch.float64, device=device)

    def mean(self, slots: torch.Tensor | Sequence[Column], out: torch.Tensor, *,
             all_gather: Gather | None = None, extra_max: torch.Tensor | None = None,
             **_unused) -> torch.Tensor:
        """``out`` (any float dtype, n elements) = the mean over all terms.

        ``extra_max``: ``extra`` values (per-parameter "used" flags) whose maximum over
        the ranks it holds afterwards (they travel in the same gather)."""
        self._fill(slots)
        if self.world > 1:
            if all_gather is None:
                raise ValueError(f"{self.rows} local rows of {self.terms} terms need "
                                 "all_gather")
            if self.extra:
                self._extras_out.copy_(extra_max.reshape(-1))
            all_gather(self._gathered, self._local)
            if self.extra:
                extra_max.copy_(self._extras_in.amax(0).view_as(extra_max))
        return self.add(out)

    def add(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` = the mean of the gathered rows: in float64, slice order, pairwise."""
        rows = self._rows64
        self._rows64_in.copy_(self._in_order)  # float32 -> float64: exact
        spare = self._half
        count = self.terms
        # A fixed pairwise tree over the slice index (a function of V alone): rows 2i
        # and 2i + 1 are added into row i, an odd last row is carried to the next level.
        while count > 1:
            half = count // 2
            torch.add(rows[0:2 * half:2], rows[1:2 * half:2], out=spare[:half])
            if count % 2:
                spare[half].copy_(rows[count - 1])
            count = half + count % 2
            rows, spare = spare, rows
        torch.div(rows[0], self._divisor, out=out.view(-1))  # in float64, then the cast
        return out.view(-1)

    def _fill(self, slots: torch.Tensor | Sequence[Column]) -> None:
        """The local rows into ``rows_view``, unless they are there already."""
        if isinstance(slots, torch.Tensor):
            if slots.data_ptr() == self.rows_view.data_ptr():
                return
        elif len(slots) == 1 and slots[0] is self.rows_view:  # the reducer's one segment
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
