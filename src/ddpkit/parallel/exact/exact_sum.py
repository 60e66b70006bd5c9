"""A sum of floating-point gradients whose bits do not depend on how it is grouped.

Float addition is not associative: summing the same V per-slice gradients as
``((g0 + g1) + g2) + g3`` on one process and ``(g0 + g2) + (g1 + g3)`` on two ranks
gives different last bits, and so does every world size and every reduction tree. This
module sums in a representation where addition *is* associative, per element ``i``:

1. ``m_i = max_k |g_k[i]|`` over every term on every rank (a local max, then an
   all-reduce with MAX, which is exact and order-free); NaN counts as +inf.
2. From ``m_i`` an exponent ``e_i`` with ``m_i < 2^e_i`` (read from the float's bits).
   Every term becomes the integer ``q_k[i] = round(g_k[i] * 2^(P - e_i))``, so
   ``|q_k[i]| <= 2^P``. ``P = 53 - ceil(log2 V)`` keeps the sum of all V terms, and
   every partial sum of them in any order, within 2^53, where float64 holds integers
   exactly: the sum of the q's is the same number whoever adds them in what order,
   on one process or with any all-reduce (gloo, NCCL, shared memory).
3. ``result_i = (sum_k q_k[i]) / (2^(P - e_i) * V)``: one float64 division (the mean
   over the V terms), then the cast to the gradient's dtype.

Accuracy. A term loses only its bits below ``2^(e_i - P)`` (rounded to nearest); a
float32 term has 24 significant bits, so only terms more than 2^(P - 25) (~10^7 at
V = 12) times smaller than the element's largest term lose any. With
``g = (sum_k g_k) / V`` the result ``r`` satisfies, per element::

    |r - g| <= u |g|  +  2^-53 |g|  +  2^-P max_k |g_k|        (u = 2^-24 for float32)

(the cast, the float64 division, the rounding of the terms; a result in float32's
subnormal range adds the cast's absolute 2^-150). The plain float32 sum
then division is bounded by ``u |g| + (V - 1) u sum_k |g_k| / V``; since
``2^-P = 2^(ceil(log2 V) - 53)`` is below ``(V - 1) u / V`` by a factor of 2^25 or
more for any V >= 2, the exact mean is never worse than float32 summation's own
bound, and in practice better: it rounds once, at the end, where float32 summation
rounds at every partial sum. At V = 1 it returns the term itself. Zeros come out as
+0 (the float64 sums start from +0). Maxima in float32's
subnormal range keep the same relative grid (the scale is applied as two factors
when it exceeds 2^126), so the bound holds down to the smallest float32.

Non-finite terms: an element with an inf or NaN term comes out inf or NaN, the same
on every grouping (its exponent is pinned and the float64 sum of non-finite values
does not depend on order).

:class:`ExactMean` works on ``slots``: one row per local term (e.g. per slice),
either a ``[rows, n]`` float32 tensor or, per segment of the n elements (per parameter,
or per run of small parameters), that segment's local terms: stacked in one tensor, or
as separate 1-D tensors (a slice's gradient where autograd left it). Communication is
the caller's (``all_reduce_max``, ``all_reduce_sum``), so one process with all V rows
and W ranks with V/W rows each run the same arithmetic. Everything is done piece by
piece, a piece of every row at a time, so each term is read from memory twice (max,
then encode), the temporaries and each piece of the maxima and of the float64 sum stay
in cache, and per-element work (the exponent, the factors, looked up in 256-entry
tables) is done once for all rows; the buffers are kept between steps (fresh memory
costs page faults every step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

# Elements of one piece of the work on a CPU: small enough that a piece's temporaries
# and its float64 sum stay in the L2 cache, large enough that Python's per-op cost is
# small next to the op.
PIECE_ELEMENTS = 1 << 15
_F32_MANTISSA_BITS = 23
_F32_MAX_FACTOR = 126  # one float32 factor is at most 2^126

Reduce = Callable[[torch.Tensor], object]
Allocate = Callable[[int, torch.dtype, torch.device | str], torch.Tensor]


def empty_buffer(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


def fixed_point_bits(terms: int) -> int:
    """P: each term becomes an integer of magnitude <= 2^P, so that ``terms`` of them
    (and any partial sum) stay within 2^53, where float64 integers are exact."""
    if terms < 1:
        raise ValueError(f"an exact sum needs at least one term, got {terms}")
    return 53 - (terms - 1).bit_length()  # (terms - 1).bit_length() == ceil(log2(terms))


# One segment's local terms: a ``[k, size]`` tensor (k terms stacked) or k 1-D tensors.
Column = torch.Tensor | Sequence[torch.Tensor]


def checked_segments(rows: int, n: int, terms: int,
                     segments: Sequence[int] | None) -> list[int]:
    """The segment lengths (``[n]`` for None), checked with the local row count."""
    if not 0 <= rows <= terms:
        raise ValueError(f"{rows} local rows of {terms} terms")
    segments = [n] if segments is None else [int(s) for s in segments]
    if sum(segments) != n or any(s < 0 for s in segments):
        raise ValueError(f"segments {segments} do not add up to {n} elements")
    return segments


def columns_of(slots: torch.Tensor | Sequence[Column], rows: int, n: int,
               segments: Sequence[int]) -> list[Column]:
    """``slots`` (a ``[rows, n]`` tensor, or per segment its local terms) as per-segment
    columns, checked: at most ``rows`` terms of the segment's length each."""
    if isinstance(slots, torch.Tensor):
        if tuple(slots.shape) != (rows, n):
            raise ValueError(f"slots {tuple(slots.shape)}, expected {(rows, n)}")
        return list(slots.split(list(segments), dim=1))
    columns = list(slots)
    if len(columns) != len(segments):
        raise ValueError(f"terms for {len(columns)} segments, expected {len(segments)}")
    for column, size in zip(columns, segments, strict=True):
        k = len(column)
        if k > rows or any(t.numel() != size for t in column):
            raise ValueError(f"a segment of {size} elements with {k} terms of "
                             f"{[t.numel() for t in column]} elements (at most "
                             f"{rows} terms)")
    return columns


class ExactMean:
    """The mean of ``terms`` float32 rows, reproducible bit for bit for any grouping of
    the rows into processes. One instance per shape: it keeps its buffers.

    ``mean(slots, out)`` with ``slots`` this process's ``[rows, n]`` rows; the other
    ``terms - rows`` rows are on the processes ``all_reduce_max``/``all_reduce_sum``
    reach (in place, across them; None: this process holds every row).

    With ``segments`` (lengths adding up to n), ``slots`` may instead be given per
    segment, as that segment's local terms: stacked in a ``[k, size]`` tensor, or as k
    1-D tensors (a slice's gradient where autograd left it, summed without first being
    copied into a row), k <= rows; a missing term is a zero term.
    """

    format = "float64"

    def __init__(self, rows: int, n: int, terms: int, *, extra: int = 0,
                 device: torch.device | str = "cpu", allocate: Allocate | None = None,
                 segments: Sequence[int] | None = None):
        self.segments = checked_segments(rows, n, terms, segments)
        self.rows, self.n, self.terms, self.extra = rows, n, terms, extra
        self.p = fixed_point_bits(terms)
        # On an accelerator there is no cache to stay in, and every op is a launch.
        on_cpu = torch.device(device).type == "cpu"
        self.piece = PIECE_ELEMENTS if on_cpu else max(n, 1)
        # (start, end) in the n elements, the segment, (start, end) inside the segment
        self._piece_list: list[tuple[int, int, int, int, int]] = []
        offset = 0
        for j, size in enumerate(self.segments):
            for a in range(0, size, self.piece):
                b = min(size, a + self.piece)
                self._piece_list.append((offset + a, offset + b, j, a, b))
            offset += size
        # The two all-reduced buffers may live where the collective reads them in place
        # (``allocate(numel, dtype, device)``: the host's shared-memory segment).
        allocate = allocate or empty_buffer
        self.maxima = allocate(n + extra, torch.float32, device)
        self.total = allocate(n, torch.float64, device)
        width = min(n, self.piece)
        self._scratch = torch.empty(width, dtype=torch.float32, device=device)
        self._scratch2 = torch.empty(max(rows, 1), width, dtype=torch.float32, device=device)
        self._bits = torch.empty(width, dtype=torch.int32, device=device)
        self._scale64 = torch.empty(width, dtype=torch.float64, device=device)
        self._factor = torch.empty(width, dtype=torch.float32, device=device)
        self._rest = torch.empty(width, dtype=torch.float32, device=device)
        # 2^k_i for every biased exponent E of a maximum, k = P + 126 - E, as float32
        # factors: at most 2^126 in one, the rest (2^(P - E), for E < P: a nonzero
        # maximum below 2^(P - 127), ~1e-23) in a second. Zero maxima need none (their
        # terms are zeros); E = 255 (inf or NaN) gets some factor, the same everywhere.
        self._encode_factors = torch.tensor(
            [math.ldexp(1.0, min(self.p + _F32_MAX_FACTOR - e, _F32_MAX_FACTOR))
             for e in range(256)], dtype=torch.float32, device=device)
        self._encode_rests = torch.tensor(
            [math.ldexp(1.0, max(self.p - e, 0)) for e in range(256)],
            dtype=torch.float32, device=device)
        # The mean's scale for every biased exponent E of a maximum: 2^-k (k = P + 126 -
        # E) times the power-of-two part 2^-t of 1/terms, leaving the division by the odd
        # part. Powers of two, so multiplying by them is exact in float64 (which divides
        # by 2^t exactly too), and dividing by the odd part afterwards rounds the same as
        # dividing by ``terms``. (E = 255, inf or NaN, scales a total that is inf or NaN.)
        twos = (terms & -terms).bit_length() - 1
        self._odd_terms = terms >> twos
        self._decode_scales = torch.tensor(
            [math.ldexp(1.0, e - self.p - _F32_MAX_FACTOR - twos) for e in range(256)],
            dtype=torch.float64, device=device)

    def _columns(self, slots: torch.Tensor | Sequence[Column]) -> list[Column]:
        return columns_of(slots, self.rows, self.n, self.segments)

    def mean(self, slots: torch.Tensor | Sequence[Column], out: torch.Tensor, *,
             all_reduce_max: Reduce | None = None, all_reduce_sum: Reduce | None = None,
             extra_max: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` (any float dtype, n elements) = the mean over all terms.

        ``extra_max``: ``extra`` float32 values carried in the same MAX all-reduce
        (per-parameter "used" flags); they hold the reduced values afterwards.
        """
        columns = self._columns(slots)
        maxima = self.maxima
        self._local_max(columns)
        if self.extra:
            maxima[self.n:].copy_(extra_max.reshape(-1))
        if all_reduce_max is not None:
            all_reduce_max(maxima)
        if self.extra:
            extra_max.copy_(maxima[self.n:].view_as(extra_max))
        self._encode(columns)
        if all_reduce_sum is not None:
            all_reduce_sum(self.total)
        return self.decode(out)

    def local_max(self, slots: torch.Tensor | Sequence[Column]) -> torch.Tensor:
        """``maxima[i] = max_k |slots[k, i]|``; NaN becomes +inf (a MAX all-reduce
        propagates NaN differently on different backends; +inf it takes the same way).

        Piece by piece over every term at once: each piece of the maxima is written
        once, from the cache, instead of read and written again for every term."""
        return self._local_max(self._columns(slots))

    def _local_max(self, columns: list[Column]) -> torch.Tensor:
        for a, b, j, sa, sb in self._piece_list:
            maxima, column = self.maxima[a:b], columns[j]
            if not len(column):
                maxima.zero_()
            elif isinstance(column, torch.Tensor):  # stacked: one op for all its terms
                part = self._scratch2[: len(column), : b - a]
                torch.abs(column[:, sa:sb], out=part)
                torch.amax(part, 0, out=maxima)
            else:
                torch.abs(column[0][sa:sb], out=maxima)
                part = self._scratch[: b - a]
                for term in column[1:]:
                    torch.abs(term[sa:sb], out=part)
                    torch.maximum(maxima, part, out=maxima)
            torch.nan_to_num_(maxima, nan=float("inf"), posinf=float("inf"))
        return self.maxima[: self.n]

    def _biased_exponents(self, a: int, b: int) -> torch.Tensor:
        # A normal float m = 1.f * 2^(E - 127) is below 2^(E - 126) =: 2^e; zero and
        # subnormal maxima (E = 0) get e = -126, still an upper bound, and inf/NaN
        # (E = 255) some e, the same everywhere. Read from the bits: frexp is slow on
        # CPU and exp2 need not be exact. The grid exponent is k = P - e = P + 126 - E.
        bits = self._bits[: b - a]
        return torch.bitwise_right_shift(self.maxima[a:b].view(torch.int32),
                                         _F32_MANTISSA_BITS, out=bits)

    def encode(self, slots: torch.Tensor | Sequence[Column]) -> torch.Tensor:
        """``total[i] = sum_k round(slots[k, i] * 2^k_i)`` in float64, exactly."""
        return self._encode(self._columns(slots))

    def _encode(self, columns: list[Column]) -> torch.Tensor:
        for a, b, j, sa, sb in self._piece_list:
            total, column = self.total[a:b], columns[j]
            if not len(column):
                total.zero_()
                continue
            biased = self._biased_exponents(a, b)
            factor = torch.index_select(self._encode_factors, 0, biased,
                                        out=self._factor[: b - a])
            rest = None
            if int(biased.min()) < self.p and bool(
                    ((biased < self.p) & (self.maxima[a:b] != 0)).any()):
                rest = torch.index_select(self._encode_rests, 0, biased,
                                          out=self._rest[: b - a])
            if isinstance(column, torch.Tensor):  # stacked: one op for all its terms
                piece = self._scratch2[: len(column), : b - a]
                torch.mul(column[:, sa:sb], factor, out=piece)  # exact
                if rest is not None:
                    piece.mul_(rest)
                piece.round_()  # to nearest, ties to even: a function of the term alone
                # exact (every partial sum is an integer below 2^53), from +0
                torch.sum(piece, 0, dtype=torch.float64, out=total)
                continue
            piece = self._scratch[: b - a]
            for m, term in enumerate(column):
                torch.mul(term[sa:sb], factor, out=piece)
                if rest is not None:
                    piece.mul_(rest)
                piece.round_()
                # the first term plus +0 makes a zero sum +0 on any grouping
                if m == 0:
                    torch.add(piece, 0.0, out=total)
                else:
                    total.add_(piece)
        return self.total

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        """``out[i] = total[i] * 2^-k_i / terms``: the scaling is exact, the division is
        the one float64 rounding, then the cast to ``out``'s dtype."""
        out = out.view(-1)
        scales, odd = self._decode_scales, self._odd_terms
        for a, b, _, _, _ in self._piece_list:
            # 2^-k_i / 2^t looked up by the maximum's biased exponent E_i (terms = odd * 2^t)
            scale = torch.index_select(scales, 0, self._biased_exponents(a, b),
                                       out=self._scale64[: b - a])
            if odd == 1:  # the division is exact scaling too: one float64 op, then the cast
                torch.mul(self.total[a:b], scale, out=out[a:b])
            else:  # exact scaling, then the one rounding division by the odd part
                torch.div(self.total[a:b].mul_(scale), odd, out=out[a:b])
        return out


__all__ = ["Column", "ExactMean", "checked_segments", "columns_of", "fixed_point_bits"]
