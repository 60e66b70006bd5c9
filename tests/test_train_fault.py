"""`ddpkit train` end to end under faults: a SIGKILLed worker, a preemption signal, a hang.

Every run is the same small job (synthetic data, 300 samples, global batch 32: 10 steps
per epoch, the last one padded; 2 epochs; 2 processes; a checkpoint every 4 steps).
An uninterrupted run is the reference: a run that lost a worker, or that was stopped
and resumed, must end with the very same parameters, bit for bit, and its sample-id log
must show every sample of every epoch trained on exactly once.
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

from ddpkit.fault import EXIT_PREEMPTED
from ddpkit.train.report import read_jsonl
from sample_audit import assert_every_sample_once

SAMPLES, STEPS_PER_EPOCH, EPOCHS = 300, 10, 2
JOB = ["--nproc-per-node", "2", "--data", "synthetic", "--synthetic-size", str(SAMPLES),
       "--batch-size", "32", "--epochs", str(EPOCHS), "--hidden", "32", "--threads", "1",
       "--no-progress", "--checkpoint-every-steps", "4", "--log-sample-ids"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_TEST_")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _start(*argv: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpkit.cli", "train", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    """Wait for `ddpkit train`; on a timeout stop it the way a scheduler would (SIGTERM:
    the agent stops its workers), then for good."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"ddpkit train did not finish in {timeout} s:\n{err[-3000:]}")
    return proc.returncode, out + err


def _train(*argv: str, **env: str) -> tuple[int, str]:
    return _finish(_start(*JOB, *argv, env=_env(**env)))


def _only_run(out: Path) -> Path:
    (run,) = out.iterdir()
    return run


def _final_params(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)


def _assert_same_params(run: Path, reference: Path) -> None:
    mine, ref = _final_params(run), _final_params(reference)
    assert mine.keys() == ref.keys()
    for key in ref:
        assert torch.equal(mine[key], ref[key]), f"{key} differs from the uninterrupted run"


def _assert_metrics_continue(run: Path, reference: Path) -> None:
    mine, ref = read_jsonl(run / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert [r["epoch"] for r in mine] == list(range(1, EPOCHS + 1))  # no epoch twice
    for a, b in zip(mine, ref, strict=True):
        for key in ("train_loss", "train_samples", "rank_train_loss", "test_loss", "test_acc"):
            assert a[key] == b[key], key


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    code, text = _train("--out-dir", str(out))
    assert code == 0, text[-3000:]
    return _only_run(out)


def test_killed_worker_is_restarted_and_the_run_ends_bit_identical(reference, tmp_path):
    # Rank 1 dies by SIGKILL after step 15 (epoch 2, mid-epoch). The last checkpoint is
    # step 12, so the restarted workers replay steps 13-15.
    code, text = _train("--out-dir", str(tmp_path), "--max-restarts", "1",
                        DDPKIT_TEST_KILL_AT_STEP="15:1")
    assert code == 0, text[-3000:]
    assert "exitcode: -9" in text  # the agent saw the SIGKILL...
    assert "resumed at step 12 (epoch 2" in text  # ...and the restart continued
    run = _only_run(tmp_path)
    _assert_same_params(run, reference)
    assert_every_sample_once(run, reference, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
                             world=2, samples=SAMPLES)
    _assert_metrics_continue(run, reference)


def test_sigterm_stops_every_rank_with_a_checkpoint_and_resume_matches(reference, tmp_path):
    # Both ranks park after step 5; SIGTERM goes to `ddpkit train` (torchrun's agent),
    # which forwards it to the workers, as SLURM does at the end of an allocation.
    proc = _start(*JOB, "--out-dir", str(tmp_path),
                  env=_env(DDPKIT_TEST_SLEEP_AT_STEP="5:*:120"))
    deadline = time.monotonic() + 180
    while not list(tmp_path.glob("*/checkpoints/step_000000004.json")):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    code, text = _finish(proc, timeout=90)
    assert code == EXIT_PREEMPTED, text[-3000:]
    run = _only_run(tmp_path)
    manifest = json.loads((run / "checkpoints" / "step_000000005.json").read_text())
    assert manifest["reason"] == "preempted"
    assert f"continue with: ddpkit train --resume {run}" in text
    assert not (run / "summary.json").exists()  # the run is not over

    # Resume; rank 1 now straggles for 2 s, within --collective-timeout 6: that is fine.
    code, text = _train("--resume", str(run), "--collective-timeout", "6",
                        DDPKIT_TEST_SLEEP_AT_STEP="7:1:2")
    assert code == 0, text[-3000:]
    assert "resumed at step 5 (epoch 1, sample 160 of 300)" in text
    _assert_same_params(run, reference)
    assert_every_sample_once(run, reference, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
                             world=2, samples=SAMPLES)
    _assert_metrics_continue(run, reference)


def test_a_rank_that_stops_arriving_is_named_within_the_timeout(tmp_path):
    timeout, margin = 3.0, 3.0
    code, text = _train("--out-dir", str(tmp_path), "--collective-timeout", str(timeout),
                        DDPKIT_TEST_SLEEP_AT_STEP="3:1:60")
    assert code != 0
    found = re.search(r"ddpkit train: error: rank 0 waited ([\d.]+) s at step 3 'step_check' "
                      r"\(timeout 3 s\) for rank 1 \(last at step 3 'train_step'", text)
    assert found, text[-3000:]
    assert float(found.group(1)) <= timeout + margin
    assert "Traceback" not in text
