"""Exact mode end to end with `ddpkit train`: final weights at W = 1, 2, 3, 4, and runs
stopped at one world size and continued at another, each against one process.

Every run is a real launch (``ddpkit train --exact``, its own processes and run
directory); the weights compared are the runs' ``model.pt``, the held-out checks their
``metrics.jsonl``. Two jobs, global batch 96 (12 slices):

* ``main``    - the main job: digits, the default MLP (``--epochs`` epochs);
* ``dropout`` - a user's model with dropout (``tests/user_recipe.py``'s
  ``make_dropout_model``) on digits, with a checkpoint every 4 steps.

Rows:

* each job at W = 1, 2, 3, 4 (``--worlds``), against W = 1;
* ``dropout`` in the default mode at W = 1 and 2 (not exact: what exact mode removes);
* ``dropout`` stopped by SIGTERM at W = 2 after its first mid-epoch checkpoint, resumed
  at W = 3;
* ``dropout`` at W = 2 with ``--max-restarts 1`` and one worker killed (SIGKILL) in
  the second epoch: the agent restarts both from the last checkpoint;
* ``dropout`` finished at W = 2 after one epoch, continued at W = 3 with ``--epochs``
  raised to the full count.

Reported per row: max |w - w(W=1)| over every parameter, whether all are ``torch.equal``,
and the largest held-out accuracy difference over the epochs.

Run:  python benchmarks/exact_resume.py [--epochs 2 --worlds 1,2,3,4]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddpkit.loop.metrics_log import read_records

ROOT = Path(__file__).resolve().parent.parent
STEPS_PER_EPOCH = 15  # digits: 1438 training samples, global batch 96 (the last padded)
JOBS = {
    "main": ["--exact", "--batch-size", "96"],
    "dropout": ["--exact", "--batch-size", "96", "--model", "user_recipe:make_dropout_model",
                "--checkpoint-every-steps", "4"],
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_TEST_")}
    path = [str(ROOT / "tests"), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), OMP_NUM_THREADS="1", **extra)
    return env


def _start(run: Path, argv: list[str], **env: str) -> subprocess.Popen:
    """``ddpkit train`` writing into ``run`` (new), or continuing it (``--resume``)."""
    where = [] if "--resume" in argv else ["--run-dir", str(run)]
    cmd = [sys.executable, "-m", "ddpkit.cli", "train", "--no-progress", *where, *argv]
    print("  $ ddpkit train " + " ".join(cmd[4:]), file=sys.stderr, flush=True)
    return subprocess.Popen(cmd, env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, expect: int = 0) -> str:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != expect:
        raise SystemExit(f"exit {proc.returncode} (expected {expect}):\n{out[-3000:]}")
    return out


def _train(run: Path, argv: list[str], **env: str) -> str:
    return _finish(_start(run, argv, **env))


def _sigterm_after_checkpoint(run: Path, argv: list[str], step: int) -> None:
    """Start the run, hold it at ``step + 1`` and SIGTERM it once ``step``'s checkpoint
    is on disk (the launcher passes the signal on; the ranks save and exit 75)."""
    proc = _start(run, argv, DDPKIT_TEST_SLEEP_AT_STEP=f"{step + 1}:*:300")
    # committed: the step's directory (renamed into place with its manifest) is there
    marker = run / "checkpoints" / f"step_{step:09d}" / "manifest.json"
    deadline = time.monotonic() + 600
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"no checkpoint of step {step}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _finish(proc, expect=75)


def _compare(run: Path, reference: Path) -> dict:
    mine = torch.load(run / "model.pt", weights_only=True)
    ref = torch.load(reference / "model.pt", weights_only=True)
    diff = max((mine[k].double() - ref[k].double()).abs().max().item() for k in ref)
    equal = mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    accs = [(a["test_acc"], b["test_acc"]) for a, b in
            zip(read_records(run / "metrics.jsonl"), read_records(reference / "metrics.jsonl"),
                strict=True)]
    return {"max_abs_diff": diff, "equal": equal,
            "test_acc_diff": max(abs(a - b) for a, b in accs), "final_acc": accs[-1][0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--worlds", default="1,2,3,4")
    args = p.parse_args(argv)
    epochs = ["--epochs", str(args.epochs)]
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="exact-resume-") as tmp:
        root = Path(tmp)
        refs = {}
        for job, flags in JOBS.items():
            for w in worlds:
                run = root / f"{job}-w{w}"
                _train(run, [*flags, *epochs, "--nproc-per-node", str(w)])
                refs.setdefault(job, run)
                rows.append((f"{job}, W={w}", _compare(run, refs[job])))
        dropout, ref = JOBS["dropout"], refs["dropout"]
        default = [f for f in dropout if f != "--exact"]
        for w in (1, 2):
            _train(root / f"default-w{w}", [*default, *epochs, "--nproc-per-node", str(w)])
        rows.append(("dropout, default mode, W=2 vs W=1",
                     _compare(root / "default-w2", root / "default-w1")))

        run = root / "sigterm"
        _sigterm_after_checkpoint(run, [*dropout, *epochs, "--nproc-per-node", "2"], 4)
        _train(run, ["--resume", str(run), "--nproc-per-node", "3"])
        rows.append(("dropout, SIGTERM at W=2 after step 4, resumed at W=3", _compare(run, ref)))

        run = root / "killed"
        kill_at = STEPS_PER_EPOCH + 3
        out = _train(run, [*dropout, *epochs, "--nproc-per-node", "2", "--max-restarts", "1"],
                     DDPKIT_TEST_KILL_AT_STEP=f"{kill_at}:1")
        if "exitcode: -9" not in out:
            raise SystemExit(f"the worker was not killed:\n{out[-3000:]}")
        rows.append((f"dropout, W=2, rank 1 SIGKILLed at step {kill_at}, --max-restarts 1",
                     _compare(run, ref)))

        run = root / "continued"
        _train(run, [*dropout, "--epochs", "1", "--nproc-per-node", "2"])
        _train(run, ["--resume", str(run), "--nproc-per-node", "3", *epochs])
        rows.append((f"dropout, finished at W=2 after 1 epoch, --epochs {args.epochs} at W=3",
                     _compare(run, ref)))

    print(f"\nexact mode, `ddpkit train`, digits, global batch 96 (12 slices), "
          f"{args.epochs} epochs; against W=1 of the same job")
    print(f"{'run':66}{'max |dw|':>11}{'equal':>7}{'test acc diff':>15}{'final acc':>11}")
    for name, r in rows:
        print(f"{name:66}{r['max_abs_diff']:11.3e}{r['equal']!s:>7}"
              f"{r['test_acc_diff']:15.4f}{r['final_acc']:11.4f}")
    exact_rows = [r for name, r in rows if "default mode" not in name]
    return 0 if all(r["equal"] for r in exact_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
