"""How often a program that ends well still exits non-zero: launched as users launch them.

    .venv/bin/python benchmarks/clean_exit.py [--runs 20] [--only NAME[,NAME]] [--source DIR]

Each row is a program from benchmarks/exit_programs (or the main job, ``ddpkit train``)
started by a launcher (``torchrun`` = ``python -m torch.distributed.run --standalone``, or
``ddpkit launch``) ``--runs`` times, the rows taking turns round by round so that load
drift hits all of them alike. A run counts as failed when any exit code is non-zero, and
as an abort when its output also says "terminate called without an active exception"
(a backend thread freeing a collective's Python objects after the interpreter began
finalizing). ``--source DIR`` runs another checkout's ``DIR/src`` (on PYTHONPATH) with
this interpreter, to compare two versions side by side. Aborts are rarer when both cores
are busy: record the load average with the figures. A JSON copy of the table goes to
benchmarks/results/clean_exit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "benchmarks", "exit_programs")
ABORT = "terminate called without an active exception"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
DDPKIT_LAUNCH = [sys.executable, "-m", "ddpkit.cli", "launch"]


@dataclass
class Row:
    name: str
    launcher: str  # "torchrun", "ddpkit launch" or "ddpkit train"
    nproc: int
    program: list[str]  # script and its arguments ([] for the main job)
    runs: int = 0
    failed: int = 0
    aborts: int = 0

    def argv(self, tmp: str) -> list[str]:
        if self.launcher == "ddpkit train":
            return [sys.executable, "-m", "ddpkit.cli", "train", "--out-dir", tmp,
                    "--no-progress"]
        launcher = TORCHRUN if self.launcher == "torchrun" else DDPKIT_LAUNCH
        script = os.path.join(PROGRAMS, self.program[0])
        return [*launcher, "--nproc-per-node", str(self.nproc), script, *self.program[1:]]


def rows() -> list[Row]:
    table = []
    for launcher in ("torchrun", "ddpkit launch"):
        table += [
            Row("default collectives, teardown", launcher, 2, ["default_collectives.py"]),
            Row("ring grid, teardown", launcher, 3, ["ring_grid.py"]),
            Row("torch all_reduce grid, teardown", launcher, 3, ["ring_grid.py", "--torch"]),
            Row("torch DDP + AdamW, teardown", launcher, 2, ["ddp_adamw.py", "--torch"]),
            Row("DataParallel + AdamW, teardown", launcher, 2, ["ddp_adamw.py"]),
            Row("DataParallel + AdamW, no teardown", launcher, 2,
                ["ddp_adamw.py", "--no-teardown"]),
        ]
    table.append(Row("main job", "ddpkit train", 2, []))
    return table


def run_once(row: Row, env: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory(prefix="ddpkit-exit-") as tmp:
        proc = subprocess.run(row.argv(tmp), cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
    row.runs += 1
    if proc.returncode != 0:
        row.failed += 1
        row.aborts += ABORT in proc.stdout + proc.stderr
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        print(f"  {row.launcher}: {row.name}: exit {proc.returncode}: {' | '.join(tail)}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated substrings of row names")
    parser.add_argument("--launchers", default="torchrun,ddpkit launch,ddpkit train")
    parser.add_argument("--source", default=None, help="another checkout to run instead")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.source:
        env["PYTHONPATH"] = os.path.join(os.path.abspath(args.source), "src")
    wanted = [w for w in args.only.split(",") if w]
    launchers = args.launchers.split(",")
    table = [r for r in rows() if r.launcher in launchers
             and (not wanted or any(w in r.name for w in wanted))]
    start = time.time()
    for round_ in range(args.runs):
        for row in table:
            run_once(row, env)
        print(f"round {round_ + 1}/{args.runs} done, load {os.getloadavg()[0]:.2f}", flush=True)
    source = args.source or ROOT
    print(f"\nsource: {source}; {args.runs} runs per row; {time.time() - start:.0f} s; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'launcher':<14} {'program':<36} {'W':>2} {'failed':>8} {'aborts':>7}")
    for r in table:
        print(f"{r.launcher:<14} {r.name:<36} {r.nproc:>2} {r.failed:>4}/{r.runs:<3} "
              f"{r.aborts:>7}")
    out = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "clean_exit.json"), "w") as f:
        json.dump({"source": source, "rows": [r.__dict__ for r in table]}, f, indent=1)


if __name__ == "__main__":
    main()
