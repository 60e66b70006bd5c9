"""`ddpkit train --exact` end to end: stopped by SIGTERM at one world size and continued
at another, it ends with the bits of an uninterrupted run on one process.

One small job with dropout (a user's model, synthetic data: 300 samples, global batch
96 = 12 slices, 4 steps per epoch, the last one padded; 2 epochs; a checkpoint
every 2 steps). The uninterrupted reference runs the same configuration through the
Trainer on one pooled rank (no launch); the interrupted run must end with its
parameters, ``torch.equal``, its held-out accuracy, and its sample-id log must show
every sample of every epoch once. A killed worker restarted by the agent and a finished
run continued with more epochs are demonstrated by benchmarks/exact_resume.py (many
launches; its result is in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ddpkit.exit_codes import EXIT_PREEMPTED
from ddpkit.loop.metrics_log import read_records
from ddpkit.loop.sample_ids import read_sample_logs
from test_exact import DROPOUT, _restoring, _trainer_params
from test_train_fault import _assert_same_params, _finish, _start
from test_train_fault import _env as fault_env

TESTS = os.path.dirname(os.path.abspath(__file__))
SAMPLES, STEPS_PER_EPOCH, EPOCHS = 300, 4, 2
JOB = ["--exact", "--data", "synthetic", "--synthetic-size", str(SAMPLES), "--batch-size", "96",
       "--model", "user_recipe:make_dropout_model", "--no-progress",
       "--checkpoint-every-steps", "2", "--log-sample-ids"]


def _env(**extra: str) -> dict[str, str]:
    """The fault tests' environment, with this directory on the path (user_recipe)."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    return fault_env(PYTHONPATH=path, **extra)


def _train(*argv: str, **env: str) -> tuple[int, str]:
    return _finish(_start(*JOB, *argv, env=_env(**env)), timeout=300)


def _assert_test_metrics_equal(run: Path, reference: Path) -> None:
    """Held-out checks of the same weights: the same accuracy; the same loss, which at
    another world size is summed over other batches (each rank's float32 sum)."""
    mine, ref = read_records(run / "metrics.jsonl"), read_records(reference / "metrics.jsonl")
    assert [r["epoch"] for r in mine] == list(range(1, EPOCHS + 1))
    for a, b in zip(mine, ref, strict=True):
        assert a["test_acc"] == b["test_acc"]
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-6)


def _assert_same_samples_every_step(run: Path, reference: Path) -> None:
    """Each step trained on the reference's global batch (whatever ranks held it), each
    (step, rank) logged once, every sample of every epoch once."""
    def by_step(path: Path) -> dict[int, list[int]]:
        records = read_sample_logs(path)
        keys = [(r["step"], r["rank"]) for r in records]
        assert len(keys) == len(set(keys)), "a replayed step was logged twice"
        steps: dict[int, list[int]] = {}
        for r in records:
            steps.setdefault(r["step"], []).extend(r["ids"])
        return {step: sorted(ids) for step, ids in steps.items()}

    mine = by_step(run)
    assert mine == by_step(reference)
    assert sorted(mine) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    for epoch in range(EPOCHS):
        steps = range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
        assert sorted(i for s in steps for i in mine[s]) == list(range(SAMPLES))


def _one_process_run(pools, directory: Path, cfg_dict) -> Path:
    """The job uninterrupted on one pooled process, writing its run directory."""
    run = directory / "run"
    (result,) = pools(1).run(_restoring, _trainer_params, cfg_dict, str(run))
    assert result["step"] == EPOCHS * STEPS_PER_EPOCH
    return run


@pytest.fixture(scope="module")
def reference(pools, tmp_path_factory) -> Path:
    return _one_process_run(pools, tmp_path_factory.mktemp("reference"), DROPOUT)


def test_sigterm_at_two_ranks_then_resume_at_three_ends_with_one_process_bits(reference,
                                                                               tmp_path):
    run = tmp_path / "run"
    proc = _start(*JOB, "--nproc-per-node", "2", "--epochs", str(EPOCHS), "--run-dir",
                  str(run), env=_env(DDPKIT_TEST_SLEEP_AT_STEP="5:*:120"))
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "step_000000004" / "manifest.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    code, text = _finish(proc, timeout=120)
    assert code == EXIT_PREEMPTED, text[-3000:]

    code, text = _train("--resume", str(run), "--nproc-per-node", "3")
    assert code == 0, text[-3000:]
    assert "resumed at step 5 (epoch 2" in text
    _assert_same_params(run, reference)
    _assert_test_metrics_equal(run, reference)
    _assert_same_samples_every_step(run, reference)

    # The slice count and the precision are part of the run: a resume that changes
    # either (each changes every step's bits) is refused.
    for option, value, change in (("--slices", "6", "train.slices: 12 -> 6"),
                                  ("--precision", "bf16", "train.precision: 'fp32' -> 'bf16'")):
        code, text = _finish(_start("--resume", str(run), option, value, env=_env()))
        assert code == 2
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines == [f"ddpkit train: error: --resume {run}: its checkpoint "
                         f"step_000000008 was written with other settings ({change}); "
                         "leave those options out to resume, or start a new run"], text


BF16 = {**DROPOUT, "train": {**DROPOUT["train"], "precision": "bf16"}}


@pytest.fixture(scope="module")
def bf16_reference(pools, tmp_path_factory) -> Path:
    """The job with --precision bf16."""
    return _one_process_run(pools, tmp_path_factory.mktemp("bf16"), BF16)


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_at_several_processes_ends_with_one_process_bits(reference, bf16_reference,
                                                              tmp_path, world):
    """`ddpkit train --exact --precision bf16` (autocast in each slice's forward) on W
    processes ends with the bits of the same job on one pooled process, which are not
    the float32 job's."""
    with pytest.raises(AssertionError):
        _assert_same_params(bf16_reference, reference)
    run = tmp_path / "run"
    code, text = _train("--precision", "bf16", "--nproc-per-node", str(world), "--epochs",
                        str(EPOCHS), "--run-dir", str(run))
    assert code == 0, text[-3000:]
    _assert_same_params(run, bf16_reference)


def test_exact_mode_on_a_world_size_its_slices_do_not_serve_is_one_line():
    code, text = _finish(_start(*JOB, "--nproc-per-node", "5", "--batch-size", "120",
                                env=_env()))
    assert code == 2
    assert text.strip() == ("ddpkit train: error: exact mode with 12 slices runs on "
                            "1, 2, 3, 4, 6, 12 processes, not 5: choose one of those, or a "
                            "slice count that 5 divides (--slices)"), text
