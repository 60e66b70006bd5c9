"""Plant one-line plausible bugs in the core algorithms; the tests must catch every one.

    .venv/bin/python tests/mutations.py [--only NAME,NAME] [--list]

Run on demand, not in the suite (minutes: each mutation runs the tests that guard its
code; on a shared machine, under the shared lock). For each mutation: copy src/ to a
scratch directory, change one line there, run the guarding tests with that copy first on
PYTHONPATH (the workers the tests start inherit it), and expect a failure. A mutation
whose line is no longer in the source is reported as stale: update it with the code.
Prints one line per mutation and exits 1 if any bug survived (or went stale).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # under src/
    old: str  # exactly one occurrence in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k/-m options


MUTATIONS = (
    Mutation(
        "ring-allgather-one-step-short",
        "ddpkit/comm/ring.py",
        "steps += [Step(chunks[(r - a) % p]) for a in range(p - 1)]",
        "steps += [Step(chunks[(r - a) % p]) for a in range(p - 2)]",
        ("tests/test_comm.py", "-m", "not slow"),
    ),
    Mutation(
        "shm-sum-skips-the-last-element-of-each-chunk",
        "ddpkit/comm/shm/shm_collectives.py",
        "            stop = min(hi, start + piece)\n            acc = mine[start:stop]",
        "            stop = min(hi - 1, start + piece)\n            acc = mine[start:stop]",
        ("tests/test_shm.py", "tests/test_ddp_comm.py", "-m", "not slow"),
    ),
    Mutation(
        "gradients-summed-not-averaged",
        "ddpkit/parallel/engine/reducer.py",
        "torch.mul(grad, 1.0 / self.divisor, out=view)",
        "view.copy_(grad)",
        ("tests/test_ddp.py", "-m", "not slow"),
    ),
    Mutation(
        "bucket-limit-never-advances-past-the-first",
        "ddpkit/parallel/engine/buckets.py",
        "limit_index[key] = min(limit_index[key] + 1, len(limits_bytes) - 1)",
        "limit_index[key] = min(limit_index[key], len(limits_bytes) - 1)",
        ("tests/test_ddp_buckets.py", "tests/test_ddp.py", "-m", "not slow"),
    ),
    Mutation(
        "every-rank-reads-rank-0s-shard",
        "ddpkit/data/partition.py",
        "positions = range(start + self.rank, padded_stop, world)",
        "positions = range(start, padded_stop, world)",
        ("tests/test_data_partition.py",),
    ),
    Mutation(
        "checkpoint-files-written-in-place",
        "ddpkit/files/durable.py",
        "    path = Path(path)\n    tmp = temporary_path(path)\n",
        "    path = Path(path)\n    tmp = path\n",
        ("tests/test_checkpoint.py", "tests/test_checkpoint_crash.py", "-m", "not slow"),
    ),
    Mutation(
        "resume-from-the-prefetched-sampler-position",
        "ddpkit/loop/run_checkpoints.py",
        '"position": self.run.position}',
        '"position": self.run.sampler.position}',
        ("tests/test_own_loop.py", "-k", "killed_worker"),
    ),
    Mutation(
        "resume-drops-the-metrics-record-of-its-own-step",
        "ddpkit/loop/metrics_log.py",
        'if int(r.get("step", step + 1)) <= step]',
        'if int(r.get("step", step + 1)) < step]',
        ("tests/test_metric_log.py",),
    ),
    Mutation(
        "initial-broadcast-copies-the-wrong-way",
        "ddpkit/parallel/engine/state_sync.py",
        "t.copy_(flat[offset : offset + t.numel()].view_as(t))",
        "flat[offset : offset + t.numel()].view_as(t).copy_(t)",
        ("tests/test_ddp.py", "-m", "not slow"),
    ),
    Mutation(
        "zero3-gather-forgets-this-ranks-stepped-chunk",
        "ddpkit/parallel/zero/sharded_params.py",
        "            flat[s.lo:s.hi].copy_(self.chunks[b])\n",
        "",
        ("tests/test_zero.py", "-k", "bit_identical", "-m", "not slow"),
    ),
    Mutation(
        "sharded-optimizer-steps-parameters-no-rank-used",
        "ddpkit/parallel/zero/sharded_params.py",
        "shard.grad = None if piece.param in unused else _part(chunk_grads[k], piece)",
        "shard.grad = _part(chunk_grads[k], piece)",
        ("tests/test_zero3.py", "-k", "unused"),
    ),
    Mutation(
        "exact-gather-adds-rank-by-rank",
        "ddpkit/parallel/exact/exact_gather.py",
        "self._rows64_in = self._rows64.view(nodes, world, n)",
        "self._rows64_in = self._rows64.view(world, nodes, n).transpose(0, 1)",
        ("tests/test_exact_order.py", "-k", "gather and backend"),
    ),
    Mutation(
        "exact-batchnorm-updates-running-statistics-per-slice",
        "ddpkit/parallel/exact/running_stats.py",
        "            module.track_running_stats = False  # normalize with the slice's",
        "            module.track_running_stats = True  # normalize with the slice's",
        ("tests/test_exact_batchnorm.py",),
    ),
    Mutation(
        "exact-batchnorm-folds-slices-rank-by-rank",
        "ddpkit/parallel/exact/running_stats.py",
        "rows = gathered.view(world, local, self.width).transpose(0, 1).reshape(",
        "rows = gathered.view(world, local, self.width).reshape(",
        ("tests/test_exact_batchnorm.py",),
    ),
)


def plant(m: Mutation, src: str) -> bool:
    """Apply ``m`` to the copy of src/ at ``src``; False if its line is not there once."""
    path = os.path.join(src, m.path)
    with open(path) as fh:
        text = fh.read()
    if text.count(m.old) != 1:
        return False
    with open(path, "w") as fh:
        fh.write(text.replace(m.old, m.new))
    return True


def run(m: Mutation) -> tuple[str, str, float]:
    """(verdict, detail, seconds): caught (the first failing test), SURVIVED, or STALE."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"ddpkit-mutation-{m.name}-") as scratch:
        src = os.path.join(scratch, "src")
        shutil.copytree(os.path.join(ROOT, "src"), src,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        if not plant(m, src):
            return "STALE", f"{m.path}: the line to change is not there exactly once", 0.0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
             "-o", "addopts=", *m.tests], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        return "SURVIVED", "every test passed", seconds
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    if proc.returncode == 1 and failed:
        return "caught", failed[0], seconds
    tail = proc.stdout.strip().splitlines()[-1:] or ["no output"]
    return "ERROR", f"pytest exit {proc.returncode}: {tail[0]}", seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated mutation names")
    p.add_argument("--list", action="store_true", help="print the mutations and exit")
    args = p.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        names = set(args.only.split(","))
        chosen = tuple(m for m in MUTATIONS if m.name in names)
        if len(chosen) != len(names):
            p.error(f"--only: unknown mutation; known: {', '.join(m.name for m in MUTATIONS)}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}\n  - {m.old.strip()}\n  + {m.new.strip()}\n"
                  f"  tests: {' '.join(m.tests)}")
        return 0
    bad = 0
    for m in chosen:
        verdict, detail, seconds = run(m)
        bad += verdict != "caught"
        print(f"{verdict:8} {m.name:46} {seconds:6.0f} s  {detail}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} planted bugs caught")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
