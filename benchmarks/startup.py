"""Where the wall time of `ddpkit train` (README defaults) goes.

    .venv/bin/python benchmarks/startup.py [--runs 3] [-- extra ddpkit train flags]

Runs the command ``--runs`` times (into a temporary --out-dir) and stamps every output
line with the time since start, then prints per run: rank 0's "run directory" line
(launcher, worker start-up, data, model), the run's own training figure, the "done" line,
the exit, and the final test accuracy; then the import costs measured in fresh
interpreters (the launcher's ``import ddpkit.cli``, whether it imported torch, a worker's
``import ddpkit.train.worker``). Record the load average with the figures: on a shared
2-core machine they move with it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DDPKIT = os.path.join(os.path.dirname(sys.executable), "ddpkit")


def one_run(extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ddpkit-startup-") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen([DDPKIT, "train", "--out-dir", out, *extra], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        marks: dict[str, float] = {}
        for line in proc.stdout:
            now = time.perf_counter() - t0
            if "run directory:" in line:
                marks["run_dir"] = now
            found = re.search(r"done: test accuracy ([\d.]+)%.* after \d+ epochs, ([\d.]+) s", line)
            if found:
                marks["done"] = now
                marks["acc"] = float(found.group(1))
                marks["train"] = float(found.group(2))
        proc.wait()
        marks["exit"] = time.perf_counter() - t0
        marks["code"] = proc.returncode
    return marks


def timed(code: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    return time.perf_counter() - t0, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("extra", nargs="*", help="more `ddpkit train` flags (after --)")
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    runs = [one_run(args.extra) for _ in range(args.runs)]
    print(f"{'run dir line':>13} {'training':>9} {'done line':>10} {'exit':>6} {'acc %':>6}")
    for r in runs:
        print(f"{r.get('run_dir', float('nan')):13.2f} {r.get('train', float('nan')):9.2f} "
              f"{r.get('done', float('nan')):10.2f} {r['exit']:6.2f} {r.get('acc', 0):6.2f}"
              + ("" if r["code"] == 0 else f"  (exit code {r['code']})"))
    print(f"median exit: {statistics.median(r['exit'] for r in runs):.2f} s")
    cli, torch_loaded = timed("import sys, ddpkit.cli; ddpkit.cli.build_parser(); "
                              "print('torch' in sys.modules)")
    worker, _ = timed("import ddpkit.train.worker")
    bare, _ = timed("pass")
    print(f"import ddpkit.cli + parser: {cli:.2f} s (torch imported: {torch_loaded}); "
          f"import ddpkit.train.worker: {worker:.2f} s; bare interpreter: {bare:.2f} s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0 if all(r["code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
