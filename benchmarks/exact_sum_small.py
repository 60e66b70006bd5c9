"""Exact mode's sum on small and large gradients: the int32 format's passes compiled, the
same passes eager, and the float64 format, side by side (one process, one thread, no
collectives: the local passes only, the part where the three differ).

Per size n (elements of one segment) and local slice count (V / W at W = 2), the median
time of ``mean`` (exponents, encode, decode; the all-reduces are left out) over
``--repeats`` calls, the three ways interleaved in a fresh random order each repeat.
It finds where compiling starts to pay: below some n the compiled call's fixed cost
is more than the eager operations' work.

Run:  python benchmarks/exact_sum_small.py [--sizes 1000,10000,...] [--repeats 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from ddpkit.parallel.exact import exact_compile
from ddpkit.parallel.exact.exact_sum32 import make_mean

WAYS = {"int32_compiled": ("int32", "1"), "int32_eager": ("int32", "0"),
        "float64": ("float64", "0")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1000,4000,10000,30000,100000,300000,1000000")
    p.add_argument("--slices", default="2,8", help="V values (at W = 2: V/2 local terms)")
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ[exact_compile.THREADS_ENV] = "1"
    g = torch.Generator().manual_seed(0)
    print(f"{'n':>9}{'V':>4}" + "".join(f"{w:>16}" for w in WAYS) + "   (median us per mean)")
    for v in (int(s) for s in args.slices.split(",")):
        rows = max(1, v // 2)
        for n in (int(s) for s in args.sizes.split(",")):
            slots = torch.randn(rows, n, generator=g)
            out = torch.empty(n)
            means = {w: make_mean(fmt, rows, n, v) for w, (fmt, _) in WAYS.items()}
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for i in range(args.repeats + 3):
                for w in random.Random(i).sample(list(WAYS), len(WAYS)):
                    os.environ[exact_compile.COMPILE_ENV] = WAYS[w][1]
                    start = time.perf_counter()
                    means[w].mean(slots, out)
                    if i >= 3:  # the first calls compile
                        times[w].append(time.perf_counter() - start)
            row = "".join(f"{statistics.median(times[w]) * 1e6:16.1f}" for w in WAYS)
            print(f"{n:9}{v:4}{row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
