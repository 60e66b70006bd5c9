"""What a freshly allocated gradient costs on the CPU, with and without glibc keeping
large blocks.

    .venv/bin/python benchmarks/fresh_gradient.py [--mib 32] [--repeats 30]

autograd allocates every gradient anew in each backward (``zero_grad()`` sets ``.grad``
to None), and the engine then scales it into its bucket. For a tensor above glibc's mmap
threshold (at most 32 MiB, lower until a block of that size has been freed once), every
allocation is a fresh mapping whose pages fault in on first touch, and every free
unmaps it again. This times, in one child process per allocator setting, the median of
(write a gradient into a tensor, scale it into a bucket slot) with the tensor

* ``fresh``: allocated anew each time (what autograd does), and
* ``reused``: allocated once (what a gradient written straight into its bucket costs),

under glibc's defaults, with ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
raised so that freed large blocks stay in the heap (what the launcher gives its workers),
and with the same two settings applied by ``mallopt`` once the process runs (what a CPU
``DataParallel`` does in a process started without the launcher). Ratios within one child are what
to compare on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from ddpkit.launcher.worker_heap import KEEP_LARGE_BLOCKS

CHILD = """
import json, os, sys, time, torch
torch.set_num_threads(1)
if os.environ.get("APPLY_IN_PROCESS") == "1":  # what a CPU DataParallel does at wrap time
    from ddpkit.launcher.worker_heap import keep_large_blocks_here
    assert keep_large_blocks_here()
n, repeats = int(sys.argv[1]), int(sys.argv[2])
bucket, source = torch.zeros(n), torch.randn(n)
kept = torch.empty(n)

def fresh():
    grad = torch.empty(n)
    grad.copy_(source)
    torch.mul(grad, 0.5, out=bucket)

def reused():
    kept.copy_(source)
    torch.mul(kept, 0.5, out=bucket)

def median_ms(fn):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3

# interleaved, so that load changes hit both alike
rounds = [(median_ms(fresh), median_ms(reused)) for _ in range(3)]
print(json.dumps({"fresh_ms": sorted(r[0] for r in rounds)[1],
                  "reused_ms": sorted(r[1] for r in rounds)[1]}))
"""



def measure(mib: float, repeats: int, env: dict[str, str]) -> dict[str, float]:
    n = int(mib * 2**20 / 4)
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(repeats)], check=True,
                         capture_output=True, text=True, env={**os.environ, **env})
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=32.0, help="gradient size")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    print(f"load average before {os.getloadavg()[0]:.2f}")
    print(f"{'allocator':<28} {'fresh ms':>9} {'reused ms':>10} {'fresh / reused':>15}")
    for label, env in (("glibc defaults", {}), ("large blocks kept in heap", KEEP_LARGE_BLOCKS),
                       ("kept, set in the process", {"APPLY_IN_PROCESS": "1"})):
        r = measure(args.mib, args.repeats, env)
        print(f"{label:<28} {r['fresh_ms']:>9.2f} {r['reused_ms']:>10.2f} "
              f"{r['fresh_ms'] / r['reused_ms']:>15.2f}")
    print(f"load average after {os.getloadavg()[0]:.2f} (2 cores); {args.mib:g} MiB fp32")


if __name__ == "__main__":
    main()
