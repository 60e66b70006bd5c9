"""Accelerate, the transformers Trainer and Lightning on ddpkit vs on torch DDP, side by side.

    flock /work/wt/cpu.lock .venv/bin/python benchmarks/frameworks.py [--repeats 3]

Each program of tests/framework_programs (unchanged framework code, 2 ranks on CPU) runs
under ``ddpkit launch`` (torch's DistributedDataParallel and CPU collectives answered by
ddpkit's, docs/frameworks.md) and under ``torchrun`` with torch's own DDP, the two
launchers taking turns ``--repeats`` times so that load drift hits both alike. Reported
per program: the median time between optimizer steps (rank 0, over every step of every
launch but each launch's first), its ratio ddpkit / torch, and, after training, the
median of a 1 KiB ``torch.distributed.all_reduce`` called inside the program as the
frameworks call it (gloo under torchrun), with the speed-up. A JSON copy goes to
benchmarks/results/frameworks.json.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "framework_programs")
LAUNCHERS = {
    "ddpkit": [sys.executable, "-m", "ddpkit.cli", "launch", "--nproc-per-node", "2"],
    "torch": [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2"],
}
# program -> its arguments for a timing run (a few hundred steps each)
WORKLOADS = {
    "accelerate": ["--epochs", "6", "--samples", "1024"],
    "trainer": ["--steps", "200"],
    "lightning": ["--epochs", "6", "--samples", "1024"],
}


def run_once(program: str, launcher: str, calls: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out:
        env["HF_HOME"] = os.path.join(out, "hf")
        argv = [*LAUNCHERS[launcher], os.path.join(PROGRAMS, f"{program}_program.py"),
                "--out", out, *WORKLOADS[program], "--all-reduce-calls", str(calls)]
        proc = subprocess.run(argv, cwd=out, env=env, capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{program} under {launcher} failed:\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "rank0.json")) as fh:
            return json.load(fh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="launches per program and launcher")
    p.add_argument("--all-reduce-calls", type=int, default=300,
                   help="timed 1 KiB all_reduce calls per launch")
    p.add_argument("--only", default=",".join(WORKLOADS), help="programs, comma-separated")
    args = p.parse_args()
    programs = args.only.split(",")
    runs: dict = {(prog, who): [] for prog in programs for who in LAUNCHERS}
    started = time.time()
    for repeat in range(args.repeats):
        for prog in programs:
            for who in LAUNCHERS:
                runs[prog, who].append(run_once(prog, who, args.all_reduce_calls))
                print(f"  round {repeat + 1}/{args.repeats}: {prog} under {who} done",
                      file=sys.stderr, flush=True)
    rows = []
    for prog in programs:
        step = {who: statistics.median(t for r in runs[prog, who] for t in r["step_s"])
                for who in LAUNCHERS}
        small = {who: statistics.median(r["all_reduce_1k_s"] for r in runs[prog, who])
                 for who in LAUNCHERS}
        routed = runs[prog, "ddpkit"][0]["routed"]
        gather = {who: statistics.median(r["all_gather_1_s"] for r in runs[prog, who])
                  for who in LAUNCHERS} if "all_gather_1_s" in runs[prog, "torch"][0] else {}
        rows.append({"program": prog, "step_ms": {w: step[w] * 1e3 for w in step},
                     "step_ratio": step["ddpkit"] / step["torch"],
                     "all_reduce_1k_us": {w: small[w] * 1e6 for w in small},
                     "all_reduce_speedup": small["torch"] / small["ddpkit"],
                     "steps_per_launch": len(runs[prog, "ddpkit"][0]["step_s"]) + 1,
                     "routed_calls_rank0": routed,
                     "all_gather_1_us": {w: gather[w] * 1e6 for w in gather}})
    print(f"W=2, CPU, {args.repeats} launches per program and launcher, taking turns; "
          f"{time.time() - started:.0f} s")
    print("| program | step, torch DDP (ms) | step, ddpkit (ms) | ddpkit / torch | "
          "1 KiB all_reduce, gloo (us) | ddpkit (us) | faster |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['program']} | {row['step_ms']['torch']:.2f} | "
              f"{row['step_ms']['ddpkit']:.2f} | {row['step_ratio']:.2f}x | "
              f"{row['all_reduce_1k_us']['torch']:.0f} | "
              f"{row['all_reduce_1k_us']['ddpkit']:.1f} | {row['all_reduce_speedup']:.0f}x |")
    for row in rows:
        if row["all_gather_1_us"]:
            print(f"{row['program']}: torch.distributed.all_gather of one int64: "
                  f"{row['all_gather_1_us']['torch']:.0f} us under torchrun (gloo), "
                  f"{row['all_gather_1_us']['ddpkit']:.1f} us under ddpkit launch (routed)")
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "frameworks.json"), "w") as fh:
        json.dump({"repeats": args.repeats, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
