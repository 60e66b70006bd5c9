"""Segmented ring vs gloo all_reduce bus bandwidth, 2 ranks.

    .venv/bin/python benchmarks/collectives.py [more `ddpkit bench collectives` options]

Same as ``ddpkit bench collectives --nproc-per-node 2 --op all_reduce --algo ring,backend
--sizes 1K:256M``; the last table line gives the ring/backend busbw ratio at >= 16 MiB
(target >= 0.8x). Extra options are passed through (e.g. ``--algo naive_ring,ring,shm,backend``).
"""

import sys

from ddpkit.cli import main

DEFAULTS = ["--nproc-per-node", "2", "--op", "all_reduce", "--algo", "ring,backend",
            "--sizes", "1K:256M"]

if __name__ == "__main__":
    sys.exit(main(["bench", "collectives", *DEFAULTS, *sys.argv[1:]]))
