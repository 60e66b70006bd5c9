"""The GPU check's ``exact_sum`` item: exact mode's int32 sum passes on the item's
device, compiled by torch.compile (Triton on CUDA) against the eager functions, bit for
bit, and both timed.

Exact mode promises the same bits whether its passes run compiled or eager (every step
of the arithmetic is exact but one rounding division and the cast, done the same way by
both). On the CPU ``tests/test_exact_compile.py`` checks it; on CUDA only this item does.
One process, no ranks: the ranks' MAX and SUM all-reduces are done here by ``amax`` and
an integer sum over the ranks' buffers, which is what the collectives compute.
"""

from __future__ import annotations

import os
import time

import torch
from gpu_check_lib import CheckFailed, Layout, Report, Setup, difference, sync

from ddpkit.parallel.exact import exact_compile
from ddpkit.parallel.exact.exact_sum32 import int32_bits, make_mean


def awkward_terms(v: int, n: int, device: str) -> torch.Tensor:
    """``v`` rows of ``n`` terms with every awkward value: zeros of both signs,
    subnormals, infinities, NaN, values near float32's largest, ties of the rounding."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(v, n, generator=g) * torch.logspace(-44, 38, n).clamp_max(1e38)
    step = 2.0 ** -(int32_bits(v) - 1)  # the grid step of an element whose largest is 1
    x[:, 0], x[:, 1] = 0.0, -0.0
    x[0, 2] = 1e-45
    x[1, 3], x[2 % v, 4] = float("inf"), float("nan")
    x[0, 5], x[1, 5] = float("inf"), float("-inf")
    x[:, 6] = 3e38
    x[:, 7] = 0.0
    x[0, 7], x[1, 7] = 1.0, 1.5 * step  # a tie of the rounding
    return x.to(device)


def mean_of(terms: torch.Tensor, groups: list[list[int]], compiled: bool,
            env: dict[str, str]) -> list[torch.Tensor]:
    """The exponents, the integer totals and the mean's bits, as ranks holding ``groups``
    of the rows compute them (tests/test_exact_compile.py compares with it on the CPU)."""
    env[exact_compile.COMPILE_ENV] = "1" if compiled else "0"
    v, n = terms.shape
    # two segments: the graphs the CPU test compiles too, so the second of it and a
    # rehearsal loads them from inductor's cache
    ranks = [make_mean("int32", len(g), n, v, device=terms.device, segments=[n - 100, 100])
             for g in groups]
    for mean, g in zip(ranks, groups, strict=True):
        mean.local_max(terms[g])
    agreed = torch.stack([m.maxima for m in ranks]).amax(0)
    for mean in ranks:
        mean.maxima.copy_(agreed)
    total = sum(m.encode(terms[g]).clone() for m, g in zip(ranks, groups, strict=True))
    ranks[0].total.copy_(total)
    result = ranks[0].decode(torch.empty(n, device=terms.device))
    return [agreed, total, result.view(torch.int32)]


def exact_sum(setup: Setup, report: Report, seconds_left) -> None:
    device = setup.device(0)
    layout = Layout(backend="one process", devices=(device,))
    env = os.environ
    previous = env.get(exact_compile.COMPILE_ENV)
    try:
        for v, groups in ((3, [[0, 2], [1]]), (4, [[0], [1], [2], [3]])):
            terms = awkward_terms(v, 4099, device)
            eager = mean_of(terms, groups, False, env)
            compiled = mean_of(terms, groups, True, env)
            if exact_compile._failed:
                raise CheckFailed(f"torch.compile failed on {device}: {exact_compile._failed[0]}")
            report.compare(f"int32 sum, V={v}, awkward terms: compiled vs eager", layout,
                           difference(compiled, eager))
        n = 8_388_608 if setup.cuda else 65_536
        terms = torch.randn(2, n, generator=torch.Generator().manual_seed(3)).to(device)
        first: dict[str, float] = {}
        bits: dict[str, list[torch.Tensor]] = {}
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for turn in range(12 if setup.cuda else 2):
            for name in times:
                sync(torch.device(device))
                started = time.perf_counter()
                bits[name] = mean_of(terms, [[0], [1]], name == "compiled", env)
                sync(torch.device(device))
                elapsed = time.perf_counter() - started
                if turn == 0:
                    first[name] = elapsed  # the compile (or its cache's load) included
                else:
                    times[name].append(elapsed)
            if turn == 0:
                report.compare(f"int32 sum, V=2, {n} random terms: compiled vs eager",
                               layout, difference(bits["compiled"], bits["eager"]))
            if seconds_left() < 20:
                break
        report.facts["first call s, eager / compiled (the compile or its cache load)"] = (
            f"{first['eager']:.2f} / {first['compiled']:.2f}")
        if times["eager"]:
            report.timing(f"int32 mean of 2 x {n} terms (max, encode, decode; two ranks' "
                          "buffers in one process)", layout, times, baseline="eager")
    finally:
        if previous is None:
            env.pop(exact_compile.COMPILE_ENV, None)
        else:
            env[exact_compile.COMPILE_ENV] = previous
