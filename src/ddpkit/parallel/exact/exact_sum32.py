"""The order-independent sum in 32 bits: exact mode's default format ("int32").

The same idea as :mod:`ddpkit.parallel.exact.exact_sum` (the "float64" format): per
element, every term is rounded onto one fixed-point grid chosen from the largest term,
and integers add associatively. What travels is narrower:

1. ``E_i``: the largest biased float32 exponent of element i's terms, one byte (uint8),
   agreed with a MAX all-reduce (exact and order-free; the exponent of the maximum is
   the maximum of the exponents). inf and NaN have E = 255.
2. ``q_k[i] = round(g_k[i] * 2^(P + 126 - E_i))``, ``|q_k[i]| <= 2^P``, summed in
   int32 locally and by a SUM all-reduce. ``P = 31 - bit_length(V)`` keeps V of them,
   and every partial sum in any order, inside int32: the same integer whoever adds.
3. ``result_i = total_i * 2^(E_i - 126 - P) / V`` in float64 (the power of two exact,
   one rounding division), then the cast to the gradient's dtype.

Bytes per element: 4 + 1 against the default mode's 4 (float32 SUM), where the
float64 format moves 4 + 8.

Accuracy: a term loses only its bits below ``2^(E_i - 127 - P)`` (half a grid step),
so with ``g`` the true mean, per element ``|r - g| <= u |g| + 2^-53 |g| + 2^-P
max_k |g_k|`` (u = 2^-24; the cast, the division, the terms' rounding). Float32
summation of V terms then the division is bounded by ``u |g| + (V - 1) u sum_k |g_k|
/ V``, and ``(V - 1) / V * 2^-24 >= 2^-25 >= 2^-P`` while ``P >= 25``: for V <= 63.
That is the largest V this format serves (:data:`INT32_MAX_TERMS`); above it exact
mode uses the float64 format (:func:`choose_format`).

Small models: the compiled passes cost a fixed time per call, more than the float64
format's eager operations take on a few thousand elements, so a model with fewer than
:data:`SMALL_SUM_ELEMENTS` trainable elements sums in float64 by default. The choice
depends on the element count and V alone, never on the world size: every world size
picks the same format, and so the same bits.

Non-finite terms: an element with an inf or NaN term has E = 255; its terms are then
counted instead (+inf, -inf, NaN: 1, 64, 4096 each) and it comes out NaN when a term is
NaN or infinities of both signs meet, else that infinity: float summation's result,
the same on every grouping.

The passes are :mod:`ddpkit.parallel.exact.exact_kernels`, run compiled or eager by
:mod:`ddpkit.parallel.exact.exact_compile`: one pass over the local terms for the
exponents (written straight into the buffer the MAX all-reduce reads), one for the
integers (straight into the SUM all-reduce's buffer), one decode straight into ``out``.
On one host (shared memory) there are no all-reduces: the buffers lie in the segment
every rank maps, so the encode reads every rank's exponents and takes their MAX
itself, and the decode reads every rank's integers and adds them itself (three
barriers order it), the same maxima and integer sums as the all-reduces give.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ddpkit.errors import ConfigError
from ddpkit.parallel.exact import exact_compile, exact_kernels
from ddpkit.parallel.exact.exact_gather import ExactMeanGather
from ddpkit.parallel.exact.exact_sum import (
    Allocate,
    Column,
    ExactMean,
    Reduce,
    checked_segments,
    columns_of,
    empty_buffer,
)

FORMATS = ("int32", "float64", "gather", "fold")
FORMAT_ENV = "DDPKIT_EXACT_SUM"
# The largest V with P = 31 - bit_length(V) >= 25 (see the module docstring).
INT32_MAX_TERMS = 63
# Fewer trainable elements than this: the float64 format by default (its eager passes
# beat the compiled calls' fixed cost there; benchmarks/exact_sum_small.py measures it).
SMALL_SUM_ELEMENTS = 1 << 14
# At most this many elements in V rows of the model (V times its trainable elements):
# the "fold" format by default (one collective and V float64 additions beat the other
# formats' two collectives and passes there; benchmarks/exact_sum_formats.py measures it).
GATHER_ELEMENTS = 1 << 18


def int32_bits(terms: int) -> int:
    """P of the int32 format: ``terms`` integers of magnitude <= 2^P sum within int32."""
    if not 1 <= terms <= INT32_MAX_TERMS:
        raise ValueError(f"the int32 exact sum serves 1..{INT32_MAX_TERMS} terms, got {terms}")
    return 31 - terms.bit_length()


def choose_format(terms: int, requested: str | None = None, *, numel: int) -> str:
    """The sum's format for ``terms`` slices of ``numel`` elements: ``requested`` (else
    ``$DDPKIT_EXACT_SUM``), else "fold" while ``terms * numel`` is at most
    :data:`GATHER_ELEMENTS`, "int32" for up to :data:`INT32_MAX_TERMS` slices of at
    least :data:`SMALL_SUM_ELEMENTS` elements and "float64" otherwise. No world size
    goes in: the same model and V sum the same way, and give the same bits, at any."""
    requested = requested or os.environ.get(FORMAT_ENV, "").strip() or None
    if requested is None:
        if terms * numel <= GATHER_ELEMENTS:
            return "fold"
        small = numel < SMALL_SUM_ELEMENTS
        return "int32" if terms <= INT32_MAX_TERMS and not small else "float64"
    if requested not in FORMATS:
        raise ConfigError(f"{FORMAT_ENV}={requested!r}: exact mode's sum format is one of "
                          f"{', '.join(FORMATS)}")
    if requested == "int32" and terms > INT32_MAX_TERMS:
        raise ConfigError(f"exact mode: the int32 sum serves at most {INT32_MAX_TERMS} "
                          f"slices, this run has {terms}; use {FORMAT_ENV}=float64 (or "
                          "leave it unset: above that it is the default)")
    return requested


class ExactMean32:
    """The "int32" format of :class:`~ddpkit.parallel.exact.exact_sum.ExactMean`: the
    same constructor, ``mean`` / ``local_max`` / ``encode`` / ``decode`` and buffers
    (``maxima``: the uint8 exponents, then the largest of them, then ``extra`` uint8
    values; ``total``: int32)."""

    format = "int32"

    def __init__(self, rows: int, n: int, terms: int, *, extra: int = 0,
                 device: torch.device | str = "cpu", allocate: Allocate | None = None,
                 segments: Sequence[int] | None = None):
        self.segments = checked_segments(rows, n, terms, segments)
        self.rows, self.n, self.terms, self.extra = rows, n, terms, extra
        self.p = int32_bits(terms)
        allocate = allocate or empty_buffer
        # Where the collectives read them in place (the host's shared segment): the
        # passes write their results there, nothing is copied in or out. The largest
        # exponent rides in the MAX with the exponents: whether an element has an inf or
        # NaN term anywhere is then known without reading the agreed exponents again.
        self.maxima = allocate(n + 1 + extra, torch.uint8, device)
        self.total = allocate(n, torch.int32, device)
        self._peak = self.maxima[n:n + 1]
        self._extras = self.maxima[n + 1:]
        self._bounds = []
        offset = 0
        for size in self.segments:
            self._bounds.append((offset, offset + size))
            offset += size
        # terms = odd * 2^twos: the power of two is part of the exact scaling, the odd
        # part the one rounding division (a tensor: no reciprocal)
        self._grid = exact_kernels.grid_base(self.p, device)
        self._twos = (terms & -terms).bit_length() - 1
        odd = terms >> self._twos
        self._odd = None if odd == 1 else torch.tensor(float(odd), dtype=torch.float64,
                                                       device=device)
        # every rank's (maxima, total[, out]) and this rank's place, per ``out`` looked up
        self._peers: dict[int, tuple | None] = {}

    def _columns(self, slots: torch.Tensor | Sequence[Column]) -> list[list[torch.Tensor]]:
        return [list(column.unbind(0)) if isinstance(column, torch.Tensor) else list(column)
                for column in columns_of(slots, self.rows, self.n, self.segments)]

    def mean(self, slots: torch.Tensor | Sequence[Column], out: torch.Tensor, *,
             all_reduce_max: Reduce | None = None, all_reduce_sum: Reduce | None = None,
             extra_max: torch.Tensor | None = None, shared=None) -> torch.Tensor:
        """``out`` (any float dtype, n elements) = the mean over all terms.

        ``extra_max``: ``extra`` small non-negative integers (0..255, e.g. per-parameter
        "used" flags) carried in the same MAX all-reduce; they hold the reduced values
        afterwards. ``shared``: where the buffers lie in a segment every rank maps (an
        :class:`~ddpkit.parallel.exact.exact_transport.ExactTransport` on one host),
        the passes read the other ranks' exponents and integers there themselves, in
        place of the two all-reduces (the same maxima and integer sums: the same bits)."""
        columns = self._columns(slots)
        self._local_max(columns)
        if self.extra:
            self._extras.copy_(extra_max.reshape(-1))
        peers = self._peer_rows(shared, out)
        if peers is not None:
            return self._mean_in_place(columns, out, peers, shared, extra_max)
        if all_reduce_max is not None:
            all_reduce_max(self.maxima)
        if self.extra:
            extra_max.copy_(self._extras.view_as(extra_max))
        special = self._special(self._peak)
        self._encode(columns, [self.maxima], special)
        if all_reduce_sum is not None:
            all_reduce_sum(self.total)
        return self._decode([out.view(-1)], [self.total], [self.maxima], special)

    def _peer_rows(self, shared, out: torch.Tensor) -> tuple | None:
        """Every rank's ``maxima``, ``total`` and ``out`` (None where ``out`` is not in
        the segment) and this rank's index, where ``shared`` has them in place; None
        otherwise. Looked up once per ``out`` (collectives: every rank together)."""
        if shared is None or self.maxima.device.type != "cpu":
            return None
        key = out.data_ptr()
        if key not in self._peers:
            views = shared.peer_views([self.maxima, self.total, out.view(-1)])
            if views is None:
                views = shared.peer_views([self.maxima, self.total])
            found = None
            if views is not None:
                mine = [row.data_ptr() for row in views[1]].index(self.total.data_ptr())
                found = (views[0], views[1], views[2] if len(views) > 2 else None, mine)
            self._peers[key] = found
        return self._peers[key]

    def _mean_in_place(self, columns, out: torch.Tensor, peers: tuple, shared,
                       extra_max: torch.Tensor | None) -> torch.Tensor:
        """The sum with every rank's buffers read where they lie: the encode takes the
        MAX of the ranks' exponents itself, the decode the SUM of their integers."""
        maxima, totals, outs, mine = peers
        shared.barrier()  # every rank's exponents (and extras, peaks) are written
        tails = torch.stack([row[self.n:] for row in maxima]).amax(0)
        if self.extra:
            extra_max.copy_(tails[1:].view_as(extra_max))
        special = self._special(tails[:1])
        self._encode(columns, maxima, special)
        shared.barrier()  # every rank's integers are written
        if outs is None:
            self._decode([out.view(-1)], totals, maxima, special)
        else:  # each rank decodes its share of the elements into every rank's out
            share = -(-self.n // (len(outs) * 16)) * 16  # whole cache lines of float32
            lo, hi = min(self.n, mine * share), min(self.n, (mine + 1) * share)
            self._decode(outs, totals, maxima, special, lo, hi)
        shared.barrier()  # no rank writes its buffers again before every rank read them
        return out.view(-1)

    def local_max(self, slots: torch.Tensor | Sequence[Column]) -> torch.Tensor:
        """``maxima[i]`` = the largest biased exponent of the local terms of element i."""
        return self._local_max(self._columns(slots))

    def _local_max(self, columns: list[list[torch.Tensor]]) -> torch.Tensor:
        outs, terms = [], []
        for (a, b), column in zip(self._bounds, columns, strict=True):
            if a < b and column:
                outs.append(self.maxima[a:b])
                terms.append(column)
            else:  # no local term: exponent 0 is below every other
                self.maxima[a:b].zero_()
        if outs:  # one call for every segment (a compiled call has a fixed cost)
            exact_compile.max_exponents(outs, terms)
        # (not in that call: inductor would read the terms again for the reduction)
        if self.n:
            torch.amax(self.maxima[: self.n], 0, keepdim=True, out=self._peak)
        return self.maxima[: self.n]

    def encode(self, slots: torch.Tensor | Sequence[Column]) -> torch.Tensor:
        """``total[i] = sum_k round(slots[k, i] * 2^k_i)`` in int32, exactly (``maxima``
        holding the agreed exponents and peaks)."""
        return self._encode(self._columns(slots), [self.maxima], self._special(self._peak))

    def _encode(self, columns: list[list[torch.Tensor]], maxima: Sequence[torch.Tensor],
                special: bool) -> torch.Tensor:
        outs, rows, terms = [], [], []
        for (a, b), column in zip(self._bounds, columns, strict=True):
            if a < b and column:
                outs.append(self.total[a:b])
                rows.append([row[a:b] for row in maxima])
                terms.append(column)
            else:
                self.total[a:b].zero_()
        if outs:  # one call for every segment
            exact_compile.encodes(outs, rows, terms, self._grid, special)
        return self.total

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        """``out[i] = total[i] * 2^-k_i / terms``: exact scaling, one float64 rounding
        division, the cast to ``out``'s dtype (``maxima`` and ``total`` agreed)."""
        return self._decode([out.view(-1)], [self.total], [self.maxima],
                            self._special(self._peak))

    def _decode(self, outs: Sequence[torch.Tensor], totals: Sequence[torch.Tensor],
                maxima: Sequence[torch.Tensor], special: bool, lo: int = 0,
                hi: int | None = None) -> torch.Tensor:
        """Elements ``lo:hi`` (all by default) of each of ``outs``; the first out."""
        hi = self.n if hi is None else hi
        if lo < hi:
            exact_compile.decode([o[lo:hi] for o in outs], [t[lo:hi] for t in totals],
                                 [row[lo:hi] for row in maxima], self.p, self._twos,
                                 self._odd, special)
        return outs[0]

    @staticmethod
    def _special(peak: torch.Tensor) -> bool:
        """Whether an element has an inf or NaN term (exponent 255; ``peak``: the largest
        exponent): only then do the passes count non-finite terms (the same bits)."""
        return int(peak) == 255


def make_mean(sum_format: str, rows: int, n: int, terms: int, **options):
    """The exact mean of ``sum_format`` ("int32", "float64", "gather" or "fold")."""
    if sum_format in ("gather", "fold"):
        return ExactMeanGather(rows, n, terms, fold=sum_format == "fold", **options)
    if sum_format == "int32":
        return ExactMean32(rows, n, terms, **options)
    if sum_format == "float64":
        return ExactMean(rows, n, terms, **options)
    raise ValueError(f"unknown exact sum format {sum_format!r}; one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "FORMAT_ENV", "GATHER_ELEMENTS", "INT32_MAX_TERMS", "SMALL_SUM_ELEMENTS",
           "ExactMean32",
           "choose_format", "int32_bits", "make_mean"]
