"""examples/50_own_loop.py (a user's own loop on ddpkit.Run) under `ddpkit launch`.

The job: a tiny character-level GPT, AdamW, warm-up + cosine LR, bf16 autocast, two
micro-batches per step, clip_grad_norm_, a DataLoader with 2 workers over a
ShardSampler; 512 blocks, global batch 16 per micro-batch: 16 optimizer steps per
epoch, 2 epochs, 2 ranks, a checkpoint every 5 steps, a metrics record every 5.
The uninterrupted run is the reference: one run stopped by SIGTERM, started again by
the same command, which then loses a worker and is restarted by the agent, must end with
its parameters bit for bit, log each step once and train on every sample of every epoch
exactly once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpkit.loop.metrics_log import read_records
from sample_audit import assert_every_sample_once

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "50_own_loop.py")
SAMPLES, STEPS_PER_EPOCH, EPOCHS, WORLD = 512, 16, 2, 2
ARGS = ["--log-sample-ids", "--threads", "1", "--checkpoint-every", "5", "--log-every", "5",
        "--log-with", "csv"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_TEST_")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _start(run_dir: Path, *launch: str, env: dict[str, str],
           args: list[str] = ARGS) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ddpkit.cli", "launch", "--nproc-per-node", str(WORLD),
            *launch, EXAMPLE, "--run-dir", str(run_dir), *args]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Stop it the way a scheduler would (the agent stops its workers), then for good.
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"the example did not finish in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def _run(run_dir: Path, *launch: str, **env: str) -> tuple[int, str]:
    return _finish(_start(run_dir, *launch, env=_env(**env)))


def _assert_same_params(run: Path, reference: Path) -> None:
    mine = torch.load(run / "model.pt", weights_only=True)
    ref = torch.load(reference / "model.pt", weights_only=True)
    assert mine.keys() == ref.keys() and ref
    for key in ref:
        assert torch.equal(mine[key], ref[key]), f"{key} differs from the uninterrupted run"


def _assert_metrics_continue(run: Path, reference: Path) -> None:
    """Each record step once, with the uninterrupted run's values (they are its steps)."""
    mine, ref = read_records(run / "metrics.jsonl"), read_records(reference / "metrics.jsonl")
    assert [r["step"] for r in mine] == list(range(5, EPOCHS * STEPS_PER_EPOCH + 1, 5))
    for a, b in zip(mine, ref, strict=True):
        for key in ("step", "epoch", "loss", "grad_norm", "lr"):
            assert a[key] == b[key], (a["step"], key)
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",")[:1] == ["epoch"] and len(rows) == 1 + len(mine)


def _assert_ends_like(run: Path, reference: Path) -> None:
    """A faulted and continued run ended as the uninterrupted one: its parameters, bit
    for bit, every sample of every epoch once, each metrics record once, with its values."""
    _assert_same_params(run, reference)
    assert_every_sample_once(run, reference, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
                             world=WORLD, samples=SAMPLES)
    _assert_metrics_continue(run, reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    code, text = _run(run)
    assert code == 0, text[-3000:]
    assert "done: 32 steps (this attempt from step 0)" in text
    return run


def test_uninterrupted_run_learns_and_logs(reference):
    records = read_records(reference / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # it learns from the text
    assert records[0]["lr"] > records[-1]["lr"]  # the cosine decays
    assert all(r["grad_norm"] > 0 for r in records)
    manifests = sorted((reference / "checkpoints").glob("step_*/manifest.json"))
    assert json.loads(manifests[-1].read_text())["reason"] == "final"


@pytest.fixture(scope="module")
def continued(tmp_path_factory) -> dict:
    """One run stopped by SIGTERM, then continued by the same command line, which loses
    a worker to SIGKILL; what each stage showed (the tests below assert on it).

    Both ranks park after step 7; SIGTERM goes to `ddpkit launch` (torchrun's agent),
    which passes it to its workers and their DataLoader workers, as SLURM does. The
    same command with --max-restarts 1 resumes at step 7; rank 1 dies by SIGKILL after
    step 23 (epoch 2); the last checkpoint is step 20, so the restarted workers replay
    steps 21-23 from the middle of the epoch.
    """
    run = tmp_path_factory.mktemp("continued") / "run"
    seen: dict = {"run": run}
    proc = _start(run, env=_env(DDPKIT_TEST_SLEEP_AT_STEP="7:*:120"))
    deadline = time.monotonic() + 120

    def parked() -> bool:  # every rank logged step 7's samples, so it sleeps right after
        logs = [run / "sample_ids" / f"rank{r}.jsonl" for r in range(WORLD)]
        return all(log.exists() and '{"step": 7,' in log.read_text() for log in logs)

    while not parked():
        if proc.poll() is not None or time.monotonic() > deadline:
            _finish(proc, timeout=1)
            pytest.fail("step 7 was not reached")
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    seen["stopped"] = _finish(proc, timeout=90)
    manifest = run / "checkpoints" / "step_000000007" / "manifest.json"
    seen["manifest"] = json.loads(manifest.read_text()) if manifest.exists() else None
    seen["model_after_stop"] = (run / "model.pt").exists()

    seen["resumed"] = _run(run, "--max-restarts", "1", DDPKIT_TEST_KILL_AT_STEP="23:1")
    return seen


def test_killed_worker_is_restarted_and_the_run_ends_bit_identical(reference, continued):
    code, text = continued["resumed"]
    assert code == 0, text[-3000:]
    assert "exitcode: -9" in text  # the agent saw the SIGKILL...
    assert "resumed at step 20 (epoch 2, sample 128 of 512)" in text  # ...and the restart resumed
    assert "done: 32 steps (this attempt from step 20)" in text
    run = continued["run"]
    _assert_ends_like(run, reference)


def test_sigterm_stops_every_rank_with_a_checkpoint_and_the_same_command_resumes(
        reference, continued):
    code, text = continued["stopped"]
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert "DataLoader worker" not in text, text[-3000:]
    assert continued["manifest"] is not None and continued["manifest"]["reason"] == "preempted"
    assert text.count("stopped at step 7; the same command continues") == WORLD
    assert not continued["model_after_stop"]

    code, text = continued["resumed"]
    assert code == 0, text[-3000:]
    assert "resumed at step 7 (epoch 1, sample 224 of 512)" in text
    run = continued["run"]
    _assert_ends_like(run, reference)


def test_a_rank_that_stops_arriving_is_named(tmp_path):
    # Rank 1 stalls after step 3; rank 0 waits in the step's agreement and names it.
    proc = _start(tmp_path / "run", env=_env(DDPKIT_TEST_SLEEP_AT_STEP="3:1:60"),
                  args=["--threads", "1", "--collective-timeout", "3"])
    code, text = _finish(proc, timeout=60)
    assert code != 0
    found = re.search(r"rank 0 waited ([\d.]+) s at step 3 'step_check' \(timeout 3 s\) for "
                      r"rank 1 \(last at step 3 'train_step'", text)
    assert found, text[-3000:]
