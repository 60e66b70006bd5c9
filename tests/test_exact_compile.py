"""Exact mode's int32 sum compiled by torch.compile gives the bits of the eager functions.

One small shape (a compile costs seconds; inductor caches it on disk for later runs),
over terms with every awkward value: zeros of both signs, subnormals, infinities of
both signs, NaN, values near float32's largest, ties of the rounding (terms exactly
half a grid step from two integers). A fake compile failure falls back to eager with
one warning.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest
import torch

from conftest import ROOT
from ddpkit.parallel.exact import exact_compile
from ddpkit.parallel.exact.exact_sum32 import int32_bits, make_mean

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from gpu_check_exact_sum import mean_of  # noqa: E402


def _step(v: int) -> float:
    """The grid step of an element whose largest term is in [1, 2)."""
    return 2.0 ** -(int32_bits(v) - 1)


def _awkward_terms(v: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(v, n, generator=g) * torch.logspace(-44, 38, n).clamp_max(1e38)
    x[:, 0], x[:, 1] = 0.0, -0.0
    x[0, 2] = 1e-45
    x[1, 3], x[2, 4] = float("inf"), float("nan")
    x[0, 5], x[1, 5] = float("inf"), float("-inf")
    x[:, 6] = 3e38
    x[:, 7], x[:, 8] = 0.0, 0.0
    x[0, 7], x[1, 7] = 1.0, 1.5 * _step(v)  # a tie of the rounding: to even, 2 steps
    x[0, 8], x[1, 8] = 1.0, 2.5 * _step(v)  # to even, 2 steps
    return x


def _run(monkeypatch, compiled: bool, terms: torch.Tensor, groups: list[list[int]]):
    """The mean as ranks holding ``groups`` of the rows would compute it; the
    exponents, totals and result (the GPU check's ``exact_sum`` item computes it the
    same way on CUDA)."""
    monkeypatch.setenv(exact_compile.COMPILE_ENV, "0")  # restored after the test
    return mean_of(terms, groups, compiled, os.environ)


@pytest.mark.parametrize("v", [3, 4])  # with and without the division by an odd part
def test_compiled_and_eager_sums_have_the_same_bits(monkeypatch, v):
    assert exact_compile.compile_wanted() or exact_compile._failed == []
    terms = _awkward_terms(v, 300)
    groups = [[0, 2], [1]] + ([[3]] if v == 4 else [])
    eager = _run(monkeypatch, False, terms, groups)
    compiled = _run(monkeypatch, True, terms, groups)
    assert not exact_compile._failed, exact_compile._failed  # it really compiled
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    # no inf or NaN anywhere: the passes without the non-finite counting
    finite = torch.nan_to_num(terms, nan=0.0, posinf=0.0, neginf=0.0)
    for a, b in zip(_run(monkeypatch, False, finite, groups),
                    _run(monkeypatch, True, finite, groups), strict=True):
        assert torch.equal(a, b)
    result = eager[2].view(torch.float32)
    assert torch.isinf(result[3]) and torch.isnan(result[4]) and torch.isnan(result[5])
    rounded = torch.tensor((1.0 + 2 * _step(v)) / v, dtype=torch.float32)
    assert result[7] == rounded and result[8] == rounded


class _Segment:
    """What exact mode's transport offers on one host, for ranks that are threads:
    every rank's buffers readable in place, and a barrier."""

    def __init__(self, ranks: int):
        self.means: list = [None] * ranks
        self.outs: list | None = None  # every rank's result buffer, if in the segment
        self._barrier = threading.Barrier(ranks, timeout=60)

    def peer_views(self, tensors):
        views = [[m.maxima for m in self.means], [m.total for m in self.means]]
        if len(tensors) == 2:
            return views
        return None if self.outs is None else [*views, self.outs]

    def barrier(self):
        self._barrier.wait()


# eager: compiled and eager passes give the same bits (the test above), and a compile
# of these list shapes costs tens of seconds on a fresh cache
@pytest.mark.parametrize(("compiled", "outs_shared"), [(False, False), (False, True)])
def test_reading_the_peers_rows_in_place_gives_the_bits_of_the_all_reduces(monkeypatch,
                                                                          compiled,
                                                                          outs_shared):
    """On one host the int32 sum reads every rank's exponents and integers where they
    lie instead of all-reducing them, and (with every rank's result buffer there too)
    each rank decodes its share of the elements into all of them: the same bits
    (awkward terms, 3 ranks as threads, a rank without a term in a segment, the
    extras' MAX)."""
    terms = _awkward_terms(4, 300)
    groups = [[0, 2], [1], [3]]
    n, segments = terms.shape[1], [200, 100]
    shared = _Segment(len(groups))
    shared.means = [make_mean("int32", 2, n, 4, segments=segments, extra=2) for _ in groups]
    used = [torch.tensor([0.0, float(r == 1)]) for r in range(3)]
    results = [torch.full((n,), 7.0) for _ in groups]
    shared.outs = results if outs_shared else None

    def rank(r):
        columns = [list(terms[groups[r], :200]), list(terms[groups[r], 200:])]
        if r == 2:  # no term in its second segment: as if zeros
            columns[1] = []
        shared.means[r].mean(columns, results[r], extra_max=used[r], shared=shared)

    monkeypatch.setenv(exact_compile.COMPILE_ENV, "1" if compiled else "0")
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    without = terms.clone()
    without[3, 200:] = 0.0
    reference = _run(monkeypatch, compiled, without, groups)[2]
    for r, result in enumerate(results):
        assert torch.equal(result.view(torch.int32), reference), r
        assert used[r].tolist() == [0.0, 1.0]


def test_a_failing_compile_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    terms = _awkward_terms(3, 150)
    eager = _run(monkeypatch, False, terms, [[0, 1, 2]])

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(exact_compile, "_compiled_pass", lambda name: broken)
    monkeypatch.setattr(exact_compile, "_failed", [])
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        fallen = _run(monkeypatch, True, terms, [[0, 1, 2]])
    for a, b in zip(eager, fallen, strict=True):
        assert torch.equal(a, b)
    warnings = [r.getMessage() for r in caplog.records if "compiling the sum failed" in
                r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler found" in warnings[0]
    assert not exact_compile.compile_wanted()


def test_the_passes_use_the_cores_of_a_rank_unless_told(monkeypatch):
    monkeypatch.delenv(exact_compile.THREADS_ENV, raising=False)
    monkeypatch.setattr(exact_compile.os, "sched_getaffinity", lambda pid: set(range(16)),
                        raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert exact_compile.sum_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert exact_compile.sum_threads() == 1
    monkeypatch.setenv(exact_compile.THREADS_ENV, "3")
    assert exact_compile.sum_threads() == 3


def test_a_worker_with_an_idle_executor_thread_exits():
    """torch.compile leaves a ThreadPoolExecutor's worker thread waiting for work; a
    training worker's exit (which joins non-daemon threads) must still end."""
    import subprocess
    import sys

    program = ("from concurrent.futures import ThreadPoolExecutor\n"
               "from ddpkit.runtime.process_exit import exit_process\n"
               "pool = ThreadPoolExecutor(1)\n"
               "pool.submit(print, 'compiled').result()\n"
               "exit_process(0)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout == "compiled\n", done.stderr
