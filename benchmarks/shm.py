"""Shared-memory all-reduce vs gloo, side by side (same as ``ddpkit bench shm``).

    .venv/bin/python benchmarks/shm.py [--nproc-per-node 2] [--sizes 4,64K,4M,32M] [--out-dir DIR]

See ddpkit/bench/shm.py for the method; results are recorded in RESULTS.md.
"""

import sys

from ddpkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "shm", *sys.argv[1:]]))
