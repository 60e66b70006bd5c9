"""Format 1 (``step_N.pt`` + per-rank files) against DCP directories: save and load time
and size on disk of the 200M-parameter model, 2 gloo ranks.

    .venv/bin/python benchmarks/checkpoint.py --formats --old-src DIR/src [--rounds 3]

(``benchmarks/checkpoint.py --formats`` runs this.) Format 1's writer exists only in
the code before DCP, so each measurement is a fresh process (``ddpkit.spawn``, 2 ranks)
of one code base: ``--old-src`` (a checkout of that code, default /work/main/src) for
format 1, this tree for DCP, alternating in every round so that load drift hits both
alike. Format 1's code: ``git archive <commit before DCP> src | tar -x -C DIR``, then
``--old-src DIR/src``. In each process: 8 x Linear(5000, 5000) (200M parameters, the
size of ``benchmarks/zero.py``'s mlp200m), ``DataParallel(shard=...)``, AdamW after one
step, then ``repeats`` times ``Checkpointer.save(collect_state(...))`` and
``load_latest`` + ``restore_state``
(the ranks meet at a barrier before and after each; rank 0's clock). Figures: medians
over rounds of each process's median; size: the bytes of one checkpoint's files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
# (width, Linear layers): benchmarks/zero.py's sizes, built here from torch alone, so
# that the format 1 process imports nothing of this tree
MODELS = {"mlp14m": (1536, 6), "mlp200m": (5000, 8)}


def _job(world, directory: str, shard: str, model_name: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ddpkit
    from ddpkit.checkpoint import Checkpointer, collect_state, restore_state

    torch.manual_seed(0)
    width, depth = MODELS[model_name]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    ddp = ddpkit.DataParallel(model, shard=shard)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    x, y = torch.randn(4, width), torch.randint(0, width, (4,))
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
    ckpt = Checkpointer(directory, keep=1)
    saves, loads = [], []
    for r in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        ckpt.save(collect_state(model=ddp, optimizer=opt, step=r + 1), r + 1)
        dist.barrier()
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        state = ckpt.load_latest()
        restore_state(state, model=ddp, optimizer=opt)
        del state
        dist.barrier()
        loads.append(time.perf_counter() - start)
    files = [p for p in Path(directory).rglob("*")
             if p.is_file() and not p.name.startswith(".ddpkit")]  # the writer fence
    size = sum(p.stat().st_size for p in files)
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
            "bytes": size, "files": sorted(p.name for p in files)}


def _worker(args: argparse.Namespace) -> None:
    import ddpkit

    with tempfile.TemporaryDirectory(dir=args.tmp) as directory:
        out = ddpkit.spawn(_job, 2, args=(directory, args.shard, args.model, args.repeats),
                           rendezvous="env")
    Path(args.out).write_text(json.dumps(out[0]))


def _one(fmt: str, shard: str, args: argparse.Namespace, out: Path) -> dict:
    src = args.old_src if fmt == "format 1" else str(SRC)
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--shard", shard, "--model", args.model,
           "--repeats", str(args.repeats), "--out", str(out),
           *(["--tmp", args.tmp] if args.tmp else [])]
    subprocess.run(cmd, env=env, check=True, cwd=HERE.parent)
    return json.loads(out.read_text())


def compare(args: argparse.Namespace) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for shard in args.shards:
                for fmt in ("format 1", "DCP") if r % 2 == 0 else ("DCP", "format 1"):
                    row = _one(fmt, shard, args, Path(scratch) / "out.json")
                    results.setdefault(shard, {}).setdefault(fmt, []).append(row)
    table = {}
    print(f"{args.model}, 2 gloo ranks, median of {args.rounds} rounds x {args.repeats} "
          "save+load each")
    print(f"{'shard':<10} {'format':<9} {'save s':>7} {'load s':>7} {'MiB':>8}  "
          "DCP / format 1: save, load, size")
    for shard, by_format in results.items():
        med = {fmt: {k: statistics.median(row[k] for row in rows)
                     for k in ("save_s", "load_s", "bytes")} for fmt, rows in by_format.items()}
        for fmt, m in med.items():
            ratio = ""
            if fmt == "DCP":
                old = med["format 1"]
                ratio = (f"  {m['save_s'] / old['save_s']:.2f}x, {m['load_s'] / old['load_s']:.2f}x"
                         f", {m['bytes'] / old['bytes']:.3f}x")
            print(f"{shard:<10} {fmt:<9} {m['save_s']:>7.2f} {m['load_s']:>7.2f} "
                  f"{m['bytes'] / 2**20:>8.1f}{ratio}")
        table[shard] = {"medians": med, "files": {f: rows[0]["files"] for f, rows
                                                    in by_format.items()}}
    return table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="saves and loads per process")
    p.add_argument("--model", default="mlp200m")
    p.add_argument("--shards", nargs="+", default=["none", "gradients"])
    p.add_argument("--old-src", required="--worker" not in sys.argv,
                   help="format 1's code: the src/ of a checkout before DCP")
    p.add_argument("--tmp", default=None, help="where the checkpoints go (default: $TMPDIR)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shard", default="none", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        _worker(args)
        return
    table = compare(args)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
