"""The elementwise passes of exact mode's 32-bit sum, as plain torch functions.

Three passes over one segment of the gradients (``terms``: the local per-slice
gradients of that segment, float32, 1-D, equal length):

* :func:`max_exponent` - ``out[i]`` (uint8) = the largest biased float32 exponent E of
  ``terms[k][i]`` over k. E is monotone in ``|x|``, so the MAX of exponents is the
  exponent of the MAX; inf and NaN have E = 255, the largest;
* :func:`encode` - ``out[i]`` (int32) = ``sum_k round(terms[k][i] * 2^(P + 126 - E_i))``
  for the agreed ``E_i``: the largest of ``exponents[r][i]`` over r (one row agreed
  already, or each rank's row read where it lies, in the host's shared segment); an
  element whose E is 255 instead counts its +inf, -inf and NaN terms (``1``, ``64``,
  ``4096`` each) so that its result is what float summation gives (NaN for a NaN or
  for infinities of both signs);
* :func:`decode` - ``outs[r][i]`` = ``total[i] * 2^(E_i - P - 126) / terms_count``, with
  ``total`` the sum of ``totals[r]`` over r (int32: exact, in any order) and ``E`` as
  above: the power-of-two part exact in float64, one rounding division by the odd
  part, then the cast to ``out``'s dtype.

Every operation is exact except the last division and cast, and each is a function of
its element alone, so these give the same bits eagerly, compiled (inductor: one fused
loop per pass, vectorized C++ on the CPU, Triton on CUDA) and in any number of pieces
or threads. Powers of two are built from their bits (``exp2`` need not be exact); the
odd divisor is a tensor, so no compiler turns the division into a multiplication by a
rounded reciprocal; non-finite checks read the integer bits, unaffected by fast-math
flags. The non-finite handling runs only where some exponent is 255 (``special``):
both variants give the same bits where none is.

:mod:`ddpkit.parallel.exact.exact_compile` runs them compiled or eager.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# +inf, -inf and NaN terms of an element whose exponent is 255 add these codes: with
# at most 63 terms each count stays below the next code, and the sum below 2^31.
POS_INF_CODE, NEG_INF_CODE, NAN_CODE = 1, 64, 4096
_CODE_BITS = 6  # 64 = 2^6
_F32_MANTISSA_BITS = 23
_F32_BIAS = 127  # a float32 with biased exponent E is in [2^(E-127), 2^(E-126))
_F64_MANTISSA_BITS = 52
_F64_BIAS = 1023


def _exponents(term: torch.Tensor) -> torch.Tensor:
    """The biased exponent field of each float32 (int32, 0..255; the sign dropped)."""
    return torch.bitwise_and(torch.bitwise_right_shift(term.view(torch.int32),
                                                       _F32_MANTISSA_BITS), 0xFF)


def _power_of_two64(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float64, exactly, built from its bits (exponent int64, normal range)."""
    return torch.bitwise_left_shift(exponent + _F64_BIAS, _F64_MANTISSA_BITS).view(torch.float64)


def max_exponent(out: torch.Tensor, terms: Sequence[torch.Tensor]) -> None:
    """``out`` (uint8) = per element, the largest biased exponent over ``terms``."""
    agreed = _exponents(terms[0])
    for term in terms[1:]:
        agreed = torch.maximum(agreed, _exponents(term))
    out.copy_(agreed)


def max_exponents(outs: Sequence[torch.Tensor],
                  columns: Sequence[Sequence[torch.Tensor]]) -> None:
    """:func:`max_exponent` for several segments in one call (``outs[j]`` from
    ``columns[j]``)."""
    for out, terms in zip(outs, columns, strict=True):
        max_exponent(out, terms)


def _agreed(exponents: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per element, the largest of the rows' biased exponents (uint8 rows), as int32."""
    agreed = exponents[0]
    for row in exponents[1:]:
        agreed = torch.maximum(agreed, row)
    # int32 exponent arithmetic (widening bytes to int64 costs more than the rest)
    return agreed.to(torch.int32)


def _power_of_two32(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float32, exactly, built from its bits (exponent int32, -126..127)."""
    return torch.bitwise_left_shift(exponent + _F32_BIAS, _F32_MANTISSA_BITS).view(torch.float32)


def grid_base(p: int, device: torch.device | str) -> torch.Tensor:
    """``P + 126`` as :func:`encode` takes it: an int32 tensor, not a Python int, so that
    a compiled encode keeps the exponent arithmetic in int32 (a symbolic int made
    inductor's Triton code widen it to int64, which cannot be reinterpreted as float32:
    the compile failed on CUDA), and one compiled loop serves every P."""
    return torch.tensor(p + _F32_BIAS - 1, dtype=torch.int32, device=device)


def encode(out: torch.Tensor, exponents: Sequence[torch.Tensor],
           terms: Sequence[torch.Tensor], grid: torch.Tensor, special: bool) -> None:
    """``out`` (int32) = per element, the sum of the terms' fixed-point integers on the
    grid ``2^(E - 126 - P)`` of the agreed exponent E (the largest of ``exponents``'
    uint8 rows; ``grid``: :func:`grid_base` of P). ``special``: some E is 255 (an inf
    or NaN term somewhere); without, the loop skips the counting of non-finite terms."""
    biased = _agreed(exponents)
    # k = P + 126 - E <= P + 126: a zero or subnormal maximum (E = 0) still gets the
    # grid of its 2^-126 bound. 2^k as two float32 factors (one holds at most 2^126);
    # each product is exact: |term| < 2^(E - 126), so |term * 2^k| < 2^P, and below
    # 2^-126 (where float32 would round) only for terms that round to 0 anyway.
    k = grid - biased
    first = _power_of_two32(torch.clamp(k, max=_F32_BIAS - 1))
    second = _power_of_two32(torch.clamp(k - (_F32_BIAS - 1), min=0))
    finite = biased != 255
    total = None
    for term in terms:
        scaled = term * first * second
        if special:  # inf * 2^k is inf: keep it out of the conversion to int32
            scaled = torch.where(finite, scaled, 0.0)
        # ties to even, a function of the term alone; |q| <= 2^P, so int32 holds it
        q = torch.round(scaled).to(torch.int32)
        if special:
            bits = term.view(torch.int32)
            code = torch.where(torch.bitwise_and(bits, 0x7FFFFF) != 0, NAN_CODE,
                               torch.where(bits < 0, NEG_INF_CODE, POS_INF_CODE))
            q = torch.where(finite, q, torch.where(_exponents(term) == 255, code, 0))
        total = q if total is None else total + q
    out.copy_(total)


def encodes(outs: Sequence[torch.Tensor], exponents: Sequence[Sequence[torch.Tensor]],
            columns: Sequence[Sequence[torch.Tensor]], grid: torch.Tensor,
            special: bool) -> None:
    """:func:`encode` for several segments in one call (``outs[j]`` from ``columns[j]``
    on the exponent rows ``exponents[j]``)."""
    for out, rows, terms in zip(outs, exponents, columns, strict=True):
        encode(out, rows, terms, grid, special)


def decode(outs: Sequence[torch.Tensor], totals: Sequence[torch.Tensor],
           exponents: Sequence[torch.Tensor], p: int, twos: int, odd: torch.Tensor | None,
           special: bool) -> None:
    """Each of ``outs`` = per element ``total * 2^(E - P - 126) / (odd * 2^twos)``
    (written to several: every rank's copy of the mean, in shared memory; ``total``: the
    sum of the int32 rows ``totals``, which stays inside int32 whatever adds it, E: as
    in :func:`encode`; the count of terms is ``odd * 2^twos``; ``odd`` a float64 scalar
    tensor, None for 1); with ``special``, an element whose exponent is 255 gets +inf,
    -inf or NaN from its codes."""
    total = totals[0]
    for row in totals[1:]:
        total = total + row
    biased = _agreed(exponents)
    scale = _power_of_two64((biased - (p + _F32_BIAS - 1 + twos)).to(torch.int64))
    mean = total.to(torch.float64) * scale
    if odd is not None:
        mean = mean / odd  # the one rounding (then the cast's)
    if not special:
        for out in outs:
            out.copy_(mean)
        return
    positive = torch.bitwise_and(total, (1 << _CODE_BITS) - 1) > 0
    negative = torch.bitwise_and(torch.bitwise_right_shift(total, _CODE_BITS),
                                 (1 << _CODE_BITS) - 1) > 0
    nan = (torch.bitwise_right_shift(total, 2 * _CODE_BITS) > 0) | (positive & negative)
    inf = torch.where(nan, float("nan"), torch.where(positive, float("inf"), float("-inf")))
    mean = torch.where(biased == 255, inf, mean)
    for out in outs:
        out.copy_(mean)


__all__ = ["NAN_CODE", "NEG_INF_CODE", "POS_INF_CODE", "decode", "encode", "encodes",
           "grid_base", "max_exponent", "max_exponents"]
