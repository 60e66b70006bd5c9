"""A sum of floating-point gradients whose bits do not depend on how it is grouped.

Float addition is not associative: summing the same V per-shard gradients as
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

:class:`ExactMean` works on ``slots``, a ``[rows, n]`` float32 tensor (one row per
local term, e.g. per virtual shard); communication is the caller's (``all_reduce_max``,
``all_reduce_sum``), so one process with all V rows and W ranks with V/W rows each run
the same arithmetic. Everything is done piece by piece, a piece of every row at a time,
so each term is read from memory twice (max, then encode) and the temporaries stay in
cache; the buffers are kept between steps (fresh memory costs page faults every step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Bytes of one piece of the [rows, n] work on a CPU: small enough that a piece's
# temporaries stay in the L2 cache, large enough that Python's per-op cost is noise.
PIECE_BYTES = 1 << 20
_F32_MANTISSA_BITS = 23
_F32_EXPONENT_BIAS = 127
_F32_MAX_FACTOR = 126  # one float32 factor is at most 2^126
_F64_MANTISSA_BITS = 52
_F64_EXPONENT_BIAS = 1023

Reduce = Callable[[torch.Tensor], object]
Allocate = Callable[[int, torch.dtype, torch.device | str], torch.Tensor]


def _empty(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


def fixed_point_bits(terms: int) -> int:
    """P: each term becomes an integer of magnitude <= 2^P, so that ``terms`` of them
    (and any partial sum) stay within 2^53, where float64 integers are exact."""
    if terms < 1:
        raise ValueError(f"an exact sum needs at least one term, got {terms}")
    return 53 - (terms - 1).bit_length()  # (terms - 1).bit_length() == ceil(log2(terms))


class ExactMean:
    """The mean of ``terms`` float32 rows, reproducible bit for bit for any grouping of
    the rows into processes. One instance per shape: it keeps its buffers.

    ``mean(slots, out)`` with ``slots`` this process's ``[rows, n]`` rows; the other
    ``terms - rows`` rows are on the processes ``all_reduce_max``/``all_reduce_sum``
    reach (in place, across them; None: this process holds every row).
    """

    def __init__(self, rows: int, n: int, terms: int, *, extra: int = 0,
                 device: torch.device | str = "cpu", allocate: Allocate | None = None):
        if not 0 <= rows <= terms:
            raise ValueError(f"{rows} local rows of {terms} terms")
        self.rows, self.n, self.terms, self.extra = rows, n, terms, extra
        self.p = fixed_point_bits(terms)
        # On an accelerator there is no cache to stay in, and every op is a launch.
        on_cpu = torch.device(device).type == "cpu"
        self.piece = max(1024, PIECE_BYTES // (4 * max(rows, 1))) if on_cpu else max(n, 1)
        # The two all-reduced buffers may live where the collective reads them in place
        # (``allocate(numel, dtype, device)``: the host's shared-memory segment).
        allocate = allocate or _empty
        self.maxima = allocate(n + extra, torch.float32, device)
        self.total = allocate(n, torch.float64, device)
        width = min(n, self.piece)
        self._scratch = torch.empty(max(rows, 1), width, dtype=torch.float32, device=device)
        self._bits = torch.empty(width, dtype=torch.int32, device=device)
        self._bits64 = torch.empty(width, dtype=torch.int64, device=device)

    def _pieces(self):
        for start in range(0, self.n, self.piece):
            yield start, min(self.n, start + self.piece)

    def mean(self, slots: torch.Tensor, out: torch.Tensor, *,
             all_reduce_max: Reduce | None = None, all_reduce_sum: Reduce | None = None,
             extra_max: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` (any float dtype, n elements) = the mean over all terms.

        ``extra_max``: ``extra`` float32 values carried in the same MAX all-reduce
        (per-parameter "used" flags); they hold the reduced values afterwards.
        """
        if tuple(slots.shape) != (self.rows, self.n):
            raise ValueError(f"slots {tuple(slots.shape)}, expected {(self.rows, self.n)}")
        maxima = self.maxima
        self.local_max(slots)
        if self.extra:
            maxima[self.n:].copy_(extra_max.reshape(-1))
        if all_reduce_max is not None:
            all_reduce_max(maxima)
        if self.extra:
            extra_max.copy_(maxima[self.n:].view_as(extra_max))
        self.encode(slots)
        if all_reduce_sum is not None:
            all_reduce_sum(self.total)
        return self.decode(out)

    def local_max(self, slots: torch.Tensor) -> torch.Tensor:
        """``maxima[i] = max_k |slots[k, i]|``; NaN becomes +inf (a MAX all-reduce
        propagates NaN differently on different backends; +inf it takes the same way)."""
        out = self.maxima[: self.n]
        if self.rows == 0:
            return out.zero_()
        for a, b in self._pieces():
            scratch = self._scratch[:, : b - a]
            torch.abs(slots[:, a:b], out=scratch)
            torch.amax(scratch, 0, out=out[a:b])
        return torch.nan_to_num_(out, nan=float("inf"), posinf=float("inf"))

    def _biased_exponents(self, a: int, b: int) -> torch.Tensor:
        # A normal float m = 1.f * 2^(E - 127) is below 2^(E - 126) =: 2^e; zero and
        # subnormal maxima (E = 0) get e = -126, still an upper bound, and inf/NaN
        # (E = 255) some e, the same everywhere. Read from the bits: frexp is slow on
        # CPU and exp2 need not be exact. The grid exponent is k = P - e = P + 126 - E.
        bits = self._bits[: b - a]
        return torch.bitwise_right_shift(self.maxima[a:b].view(torch.int32),
                                         _F32_MANTISSA_BITS, out=bits)

    def encode(self, slots: torch.Tensor) -> torch.Tensor:
        """``total[i] = sum_k round(slots[k, i] * 2^k_i)`` in float64, exactly."""
        if self.rows == 0:
            return self.total.zero_()
        # 2^k as float32 has the biased exponent k + 127 = P + 253 - E, at most 253
        # (2^126). A nonzero maximum below 2^(P - 126) (~1e-23) needs a larger k,
        # applied as a second factor (zero maxima need none: their terms are zeros).
        top = self.p + _F32_MAX_FACTOR + _F32_EXPONENT_BIAS
        cap = _F32_MAX_FACTOR + _F32_EXPONENT_BIAS
        for a, b in self._pieces():
            factor = torch.sub(top, self._biased_exponents(a, b), out=self._bits[: b - a])
            rest = None
            if int(factor.max()) > cap and bool(
                    ((factor > cap) & (self.maxima[a:b] != 0)).any()):
                rest = (factor - _F32_MAX_FACTOR).clamp_min_(_F32_EXPONENT_BIAS)
            factor.clamp_max_(cap).bitwise_left_shift_(_F32_MANTISSA_BITS)
            piece = self._scratch[:, : b - a]
            torch.mul(slots[:, a:b], factor.view(torch.float32), out=piece)  # exact
            if rest is not None:
                piece.mul_(rest.bitwise_left_shift_(_F32_MANTISSA_BITS).view(torch.float32))
            piece.round_()  # to nearest, ties to even: a function of the term alone
            torch.sum(piece, 0, dtype=torch.float64, out=self.total[a:b])  # exact: < 2^53
        return self.total

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        """``out[i] = total[i] * 2^-k_i / terms``: the scaling is exact, the division is
        the one float64 rounding, then the cast to ``out``'s dtype."""
        out = out.view(-1)
        for a, b in self._pieces():
            biased = self._biased_exponents(a, b)
            # 2^-k as float64 bits: (1023 - P - 126 + E) << 52
            bits = self._bits64[: b - a]
            bits.copy_(biased).add_(_F64_EXPONENT_BIAS - self.p - _F32_MAX_FACTOR)
            bits.bitwise_left_shift_(_F64_MANTISSA_BITS)
            total = self.total[a:b].mul_(bits.view(torch.float64))
            out[a:b].copy_(total.div_(self.terms))
        return out


__all__ = ["ExactMean", "fixed_point_bits"]
