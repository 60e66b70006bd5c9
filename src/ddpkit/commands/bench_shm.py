"""``ddpkit bench shm``: shared-memory all-reduce vs gloo (plug-in of ``ddpkit bench``)."""

from __future__ import annotations

import os
import sys

from ddpkit.commands.old_spellings import keep_old_spellings
from ddpkit.commands.out_dir import fresh_dir
from ddpkit.errors import ConfigError


def register(bench_sub) -> None:
    # ddpkit.bench.shm imports torch: not while building the parser every command uses.
    p = bench_sub.add_parser(
        "shm",
        help="shared-memory all_reduce (private, signed and allocated tensors) vs gloo",
        description=(
            "Spawn N local ranks and time all_reduce at each size, interleaved: gloo; "
            "ddpkit.comm.all_reduce with check on and off (the same code on shm: their gap "
            "is run-to-run spread); shm on private tensors (copied through shared slots) "
            "without and with the public layer's in-band signature (the gap is what the "
            "check costs); and shm on tensors from allocate() (no copy, what DataParallel "
            "buckets get). Prints time, bus bandwidth and ratio to gloo, checks the "
            "targets, writes CSV, JSON and a PNG."),
    )
    p.add_argument("--nproc-per-node", type=int, default=2, metavar="N",
                   help="ranks to spawn on this machine")
    p.add_argument("--sizes", default=None,
                   help="comma-separated message sizes, e.g. 4,64K,4M (default: "
                        "4,1K,16K,64K,256K,1M,4M,16M,32M)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="seconds of timing per size and algorithm")
    p.add_argument("--out-dir", default=None,
                   help="where CSV/JSON/PNG go (default: runs/bench-shm-<time>)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    keep_old_spellings(p, "bench shm")
    p.set_defaults(func=run)


def run(args) -> int:
    from ddpkit.bench import shm as shm_bench

    args.sizes = args.sizes or shm_bench.DEFAULT_SIZES

    if args.nproc_per_node < 2:
        raise ConfigError(f"--nproc-per-node must be >= 2 to compare all-reduces, got "
                          f"{args.nproc_per_node}")
    try:
        sizes = tuple(shm_bench.parse_size(s) for s in args.sizes.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--sizes {args.sizes!r}: use sizes like 4,64K,4M") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes {args.sizes!r}: give one or more sizes >= 1 byte")
    if args.budget <= 0:
        raise ConfigError(f"--budget must be positive, got {args.budget}")
    out_dir = args.out_dir or fresh_dir(os.path.join("runs", "bench-shm"))
    if os.path.exists(os.path.join(out_dir, "shm.json")):
        raise ConfigError(f"{out_dir}/shm.json exists; pass another --out-dir")
    print(f"ddpkit bench shm: {args.nproc_per_node} ranks, {len(sizes)} sizes; progress below",
          file=sys.stderr)
    cfg = shm_bench.Config(nprocs=args.nproc_per_node, sizes=sizes, budget_s=args.budget)
    rows = shm_bench.run(cfg)
    print(shm_bench.shm_table(rows, args.nproc_per_node))
    paths = shm_bench.write_outputs(rows, out_dir, plot=not args.no_plot)
    print(f"# wrote {', '.join(paths)}")
    return 0
