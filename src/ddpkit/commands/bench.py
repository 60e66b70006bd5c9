"""``ddpkit bench <what>``: benchmarks that print a table and write CSV/JSON/PNG.

``bench collectives`` lives here, ``bench shm`` in :mod:`ddpkit.commands.bench_shm`; the
harnesses themselves are in :mod:`ddpkit.bench`. To add a benchmark, add its
``register(bench_subparsers)`` to BENCHES.
"""

from __future__ import annotations

import os
import sys

from ddpkit.commands import bench_shm
from ddpkit.commands.old_spellings import keep_old_spellings
from ddpkit.commands.out_dir import fresh_dir
from ddpkit.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: collectives bus bandwidth, shared memory vs gloo")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for register_bench in BENCHES:
        register_bench(bench_sub)


def _register_collectives(bench_sub) -> None:
    p = bench_sub.add_parser(
        "collectives",
        help="bus bandwidth of ddpkit.comm algorithms side by side (nccl-tests style)",
        description="Spawn N local ranks and time one collective over a sweep of sizes for "
        "each algorithm, alternating algorithms so noise hits all alike. Prints a table "
        "(bytes, elements, time, algbw, busbw) and writes CSV, JSON and a PNG plot.",
    )
    p.add_argument("--nproc-per-node", type=int, default=2, metavar="N",
                   help="ranks to spawn on this machine")
    p.add_argument("--op", default="all_reduce",
                   help="all_reduce, reduce_scatter, all_gather, broadcast or reduce")
    p.add_argument("--algo", default="ring,backend",
                   help="comma-separated algorithms (any registered name, e.g. ring, "
                        "naive_ring, backend, shm, auto)")
    p.add_argument("--sizes", default="1K:256M",
                   help="MIN:MAX (powers of two), MIN:MAX:FACTOR, or a list 1K,16M")
    p.add_argument("--dtype", default="float32", help="element type of the tensors")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds per size")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per size (median)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / --nproc-per-node)")
    p.add_argument("--out-dir", default=None,
                   help="where CSV/JSON/PNG go (default: runs/bench-collectives-<time>)")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing each algorithm's result with torch's before timing")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    keep_old_spellings(p, "bench collectives")
    p.set_defaults(func=run_collectives)


def run_collectives(args) -> int:
    from ddpkit.bench import collective_timing as bench

    algos = tuple(a.strip() for a in args.algo.split(",") if a.strip())
    cfg = bench.BenchConfig(
        op=args.op, algos=algos, sizes=tuple(bench.parse_sizes(args.sizes)), dtype=args.dtype,
        nproc=args.nproc_per_node, warmup=args.warmup, repeats=args.repeats,
        check=not args.no_check, threads=args.threads,
    )
    bench.check_config(cfg)
    out_dir = args.out_dir or fresh_dir(os.path.join("runs", "bench-collectives"))
    if args.threads is not None and args.threads < 1:
        raise ConfigError("--threads must be >= 1")
    bench.refuse_taken_out_dir(out_dir, cfg.op)  # refuse before minutes of measuring, not after
    print(f"ddpkit bench collectives: {cfg.op} on {cfg.nproc} ranks, algorithms "
          f"{', '.join(algos)}, {len(cfg.sizes)} sizes; progress below", file=sys.stderr)
    result = bench.run(cfg)
    print(bench.collectives_table(result))
    paths = bench.write_outputs(result, out_dir, plot=not args.no_plot)
    print(f"# wrote {', '.join(paths)}")
    return 0


# Order here is the order in `ddpkit bench --help`.
BENCHES = (_register_collectives, bench_shm.register)
