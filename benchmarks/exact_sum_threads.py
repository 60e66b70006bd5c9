"""Exact mode's int32 sum passes, compiled for a given thread count, on one process.

The three passes of ``ddpkit/parallel/exact/exact_kernels.py`` (local exponent max,
encode, decode) under ``torch.compile(..., options={"cpp.threads": N})`` while torch's
own thread count stays 1 (as exact mode pins it), on ``--elements`` float32 elements
with ``--terms`` local terms (seeded, so runs can be compared): the median of
``--repeats`` calls per pass, and checksums of the integers and the result (the same
for every thread count when the passes do not depend on it). Beside them, "read": one
eager ``torch.sum`` over every term, the time this core takes to read them once (the
local max and the encode each read every term; what the passes cannot go below).

Run:  python benchmarks/exact_sum_threads.py --threads 2 [--elements 8400000 --terms 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ddpkit.parallel.exact import exact_kernels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--elements", type=int, default=8_400_000)
    p.add_argument("--terms", type=int, default=4)
    p.add_argument("--slices", type=int, default=8, help="V: sets P and the divisor")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = args.elements
    terms = [torch.randn(n) for _ in range(args.terms)]
    exponents = torch.empty(n, dtype=torch.uint8)
    total = torch.empty(n, dtype=torch.int32)
    result = torch.empty(n)
    p_bits = 31 - args.slices.bit_length()
    twos = (args.slices & -args.slices).bit_length() - 1
    odd = args.slices >> twos
    divisor = None if odd == 1 else torch.tensor(float(odd), dtype=torch.float64)

    def compiled(name):
        return torch.compile(getattr(exact_kernels, name), dynamic=True, fullgraph=True,
                             options={"cpp.threads": args.threads})

    grid = exact_kernels.grid_base(p_bits, "cpu")
    passes = {
        "local max": (compiled("max_exponent"), (exponents, terms)),
        "encode": (compiled("encode"), (total, [exponents], terms, grid, False)),
        "decode": (compiled("decode"), ([result], [total], [exponents], p_bits, twos,
                                        divisor, False)),
        "read": (lambda ts: [t.sum() for t in ts], (terms,)),
    }
    times = {name: [] for name in passes}
    for repeat in range(args.repeats + 1):  # the first: compile
        for name, (fn, fn_args) in passes.items():
            start = time.perf_counter()
            fn(*fn_args)
            if repeat:
                times[name].append(time.perf_counter() - start)
    medians = "  ".join(f"{name} {statistics.median(t) * 1e3:.2f} ms"
                        for name, t in times.items())
    print(f"{args.threads} thread(s), {n} elements, {args.terms} terms: {medians}; "
          f"checksums {int(total.long().sum())} {int(result.view(torch.int32).long().sum())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
