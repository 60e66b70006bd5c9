"""Exact mode's 32-bit sum passes, compiled by torch's own compiler, eager as the fallback.

:mod:`ddpkit.parallel.exact.exact_kernels` holds the passes as plain torch functions.
Here they run compiled with ``torch.compile`` (inductor: one fused loop per pass,
vectorized C++ on the CPU, Triton on CUDA), each term read once per pass, results
written straight into the caller's buffers, no full-size temporaries. Compiled and
eager give the same bits (every step is exact but the one rounding division and the
cast, which both do the same way), so eager is the fallback:

* ``DDPKIT_EXACT_COMPILE=0`` turns compiling off (eager from the start);
* when compiling fails (no C++ compiler, a torch without inductor, ...) the process
  logs one warning and runs eager from then on.

Eager runs the same functions piece by piece (cache-sized pieces, so their
temporaries stay in the cache).

Threads: the passes' bits do not depend on how many threads split them, so the
compiled loops use every core the rank has (:func:`sum_threads`: the cores this
process may run on, divided among the host's ranks; ``DDPKIT_EXACT_SUM_THREADS=N``
sets it) while torch's own thread count stays pinned for the slices' forward and
backward (:mod:`ddpkit.parallel.exact.slices`). The compiled code is cached by inductor (its
directory: ``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``):
the first process on a machine pays the compile, later ones load it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from ddpkit.log import get_logger
from ddpkit.parallel.exact import exact_kernels

log = get_logger(__name__)

COMPILE_ENV = "DDPKIT_EXACT_COMPILE"
THREADS_ENV = "DDPKIT_EXACT_SUM_THREADS"
# Elements per eager piece: a piece of every term and the piece's temporaries stay in
# the L2 cache, and Python's per-op cost stays small next to the op.
EAGER_PIECE = 1 << 15

_compiled: dict[tuple[str, int], Callable] = {}
_failed: list[str] = []  # the first compile failure's message, if any


def compile_wanted() -> bool:
    """Whether the passes run compiled here: not turned off by the environment and no
    compile has failed in this process."""
    return os.environ.get(COMPILE_ENV, "1").strip().lower() not in ("0", "false", "no",
                                                                    "off") and not _failed


def sum_threads() -> int:
    """Threads for the compiled passes: ``$DDPKIT_EXACT_SUM_THREADS``, else the cores
    this process may run on divided by the ranks on its host (``LOCAL_WORLD_SIZE``, as
    launchers set it; else ``WORLD_SIZE``: all on one host, the cautious guess)."""
    setting = os.environ.get(THREADS_ENV, "").strip()
    if setting:
        return max(1, int(setting))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1"
    return max(1, cores // max(1, int(local)))


def _compiled_pass(name: str) -> Callable:
    threads = sum_threads()
    fn = _compiled.get((name, threads))
    if fn is None:
        # dynamic: one kernel for every segment length (fewer compiles); fullgraph: a
        # graph break would leave eager pieces behind without saying so; the thread
        # count is fixed in the generated loop (OpenMP), whatever torch's is
        fn = _compiled[(name, threads)] = torch.compile(
            getattr(exact_kernels, name), dynamic=True, fullgraph=True,
            options={"cpp.threads": threads})
    return fn


def _compiled_call(name: str, *args) -> bool:
    """``exact_kernels.<name>(*args)`` compiled, when wanted; whether it ran."""
    if not compile_wanted():
        return False
    try:
        _compiled_pass(name)(*args)
        return True
    except Exception as exc:  # noqa: BLE001  any compile failure: eager from here on
        _failed.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        log.warning(f"exact mode: compiling the sum failed ({_failed[0]}); it runs "
                    f"eager (the same bits, slower). {COMPILE_ENV}=0 skips the attempt")
        return False


def _eager(name: str, out: torch.Tensor | list[torch.Tensor],
           elementwise: Sequence[Sequence[torch.Tensor]], *scalars) -> None:
    """``exact_kernels.<name>(out, *elementwise, *scalars)`` eager, in cache-sized pieces
    (``out``: a tensor or a list of them; ``elementwise``: lists of tensors as long)."""
    several = isinstance(out, list)
    eager = getattr(exact_kernels, name)
    first = out[0] if several else out
    n = first.numel()
    # pieces keep a CPU's temporaries in its cache; on a GPU they only multiply launches
    size = EAGER_PIECE if first.device.type == "cpu" else max(n, 1)
    for a in range(0, n, size):
        b = min(n, a + size)
        piece = [o[a:b] for o in out] if several else out[a:b]
        eager(piece, *([t[a:b] for t in rows] for rows in elementwise), *scalars)


def max_exponents(outs: Sequence[torch.Tensor],
                  columns: Sequence[Sequence[torch.Tensor]]) -> None:
    """Per segment j: ``outs[j]`` = the largest exponents over ``columns[j]`` (one
    compiled call for all segments)."""
    columns = [list(terms) for terms in columns]
    if not _compiled_call("max_exponents", list(outs), columns):
        for out, terms in zip(outs, columns, strict=True):
            _eager("max_exponent", out, (terms,))


def encodes(outs: Sequence[torch.Tensor], exponents: Sequence[Sequence[torch.Tensor]],
            columns: Sequence[Sequence[torch.Tensor]], grid: torch.Tensor,
            special: bool) -> None:
    """Per segment j: ``outs[j]`` = the integers of ``columns[j]`` on the grid of the
    largest of the exponent rows ``exponents[j]`` (one compiled call for all)."""
    exponents = [list(rows) for rows in exponents]
    columns = [list(terms) for terms in columns]
    if _compiled_call("encodes", list(outs), exponents, columns, grid, special):
        return
    for out, rows, terms in zip(outs, exponents, columns, strict=True):
        _eager("encode", out, (rows, terms), grid, special)


def decode(outs: Sequence[torch.Tensor], totals: Sequence[torch.Tensor],
           exponents: Sequence[torch.Tensor], p: int, twos: int, odd: torch.Tensor | None,
           special: bool) -> None:
    outs, totals, exponents = list(outs), list(totals), list(exponents)
    if not _compiled_call("decode", outs, totals, exponents, p, twos, odd, special):
        _eager("decode", outs, (totals, exponents), p, twos, odd, special)


__all__ = ["COMPILE_ENV", "THREADS_ENV", "compile_wanted", "decode", "encodes",
           "max_exponents", "sum_threads"]
