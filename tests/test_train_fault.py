"""`ddpkit train` end to end under faults: one run whose launcher is SIGKILLed, then
stopped by a preemption signal, then loses a SIGKILLed worker, each followed by the same
command line; (marked ``chaos``) a full disk, a stopped rank.

Every run is the same small job (synthetic data, 300 samples, global batch 32: 10 steps
per epoch, the last one padded; 2 epochs; 2 processes; a checkpoint every 4 steps).
The job uninterrupted, trained once per session on 2 pooled ranks, is the reference: a
run that lost a worker, or that was stopped and resumed, must end with the very same
parameters, bit for bit, and its sample-id log must show every sample of every epoch
trained on exactly once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from chaos_harness import (
    FRAME_DUMP,
    MARKER,
    can_mount,
    fill,
    is_loopback,
    listening_sockets,
    marked,
    seconds_until_gone,
    small_filesystem,
    small_filesystem_or_skip,
    worker_pid,
)
from conftest import skip_unless_required
from ddpkit.exit_codes import EXIT_DISK_FULL, EXIT_HANG, EXIT_PREEMPTED
from ddpkit.loop.metrics_log import read_records
from sample_audit import assert_every_sample_once

SAMPLES, STEPS_PER_EPOCH, EPOCHS = 300, 10, 2
TRAIN = ["--data", "synthetic", "--synthetic-size", str(SAMPLES), "--batch-size", "32",
         "--epochs", str(EPOCHS), "--hidden", "32", "--threads", "1", "--no-progress",
         "--checkpoint-every-steps", "4", "--log-sample-ids"]
JOB = ["--nproc-per-node", "2", *TRAIN]


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


def _final_params(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)


def _assert_same_params(run: Path, reference: Path) -> None:
    mine, ref = _final_params(run), _final_params(reference)
    assert mine.keys() == ref.keys() and ref
    for key in ref:
        assert torch.equal(mine[key], ref[key]), f"{key} differs from the uninterrupted run"


def _assert_metrics_continue(run: Path, reference: Path) -> None:
    mine, ref = read_records(run / "metrics.jsonl"), read_records(reference / "metrics.jsonl")
    assert [r["epoch"] for r in mine] == list(range(1, EPOCHS + 1))  # no epoch twice
    for a, b in zip(mine, ref, strict=True):
        for key in ("train_loss", "train_samples", "rank_train_loss", "test_loss", "test_acc"):
            assert a[key] == b[key], key


def _assert_ends_like(run: Path, reference: Path) -> None:
    """A faulted and continued run ended as the uninterrupted one: its parameters, bit
    for bit, every sample of every epoch once, each metrics record once, with its values."""
    _assert_same_params(run, reference)
    assert_every_sample_once(run, reference, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
                             world=2, samples=SAMPLES)
    _assert_metrics_continue(run, reference)


@pytest.fixture(scope="module")
def reference(train_reference) -> Path:
    """The job uninterrupted, on 2 pooled ranks (no launch: tests/train_reference.py)."""
    return train_reference(2, TRAIN)


# ---------------------------------------------------------------------- chaos (subset)
# The chaos run (benchmarks/chaos.py) tries every fault many times; these are one of each
# kind that must never regress, in as few launches as tell them apart: the launcher
# SIGKILLed, a preemption signal and a SIGKILLed worker in one run continued by the same
# command line; a full disk; a stopped rank.
def _wait_for(path_glob: Path | str, proc: subprocess.Popen, root: Path, limit: float = 180):
    deadline = time.monotonic() + limit
    while not list(root.glob(str(path_glob))):
        assert proc.poll() is None, f"ddpkit train ended early:\n{_finish(proc)[1][-3000:]}"
        assert time.monotonic() < deadline, f"{path_glob} did not appear"
        time.sleep(0.1)


def _wait_for_step_line(step: int, rank: int, proc: subprocess.Popen, root: Path,
                        limit: float = 180):
    """Until ``rank`` has written its sample-id line of ``step`` (``--log-sample-ids``:
    flushed at the step's end, before the fault hooks run)."""
    deadline = time.monotonic() + limit
    while True:
        for path in root.glob(f"*/sample_ids/rank{rank}.jsonl"):
            if any(line.startswith(f'{{"step": {step},') for line in path.read_text().splitlines()):
                return
        assert proc.poll() is None, f"ddpkit train ended early:\n{_finish(proc)[1][-3000:]}"
        assert time.monotonic() < deadline, f"rank {rank} did not reach step {step}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def continued(tmp_path_factory) -> dict:
    """One run that meets three faults, each followed by the same command line, and what
    each stage showed (the tests below assert on it):

    1. `ddpkit train --max-restarts 2` is SIGKILLed while both ranks are parked after
       step 5: its workers must go with it, and nothing may write to the run after;
    2. the same command line (a scheduler's rerun) continues; SIGTERM, as SLURM sends at
       the end of an allocation, stops every rank after step 9 with a checkpoint;
    3. --resume; rank 1 straggles for 2 s after step 12, within --collective-timeout 6
       (that is fine), then dies by SIGKILL after step 15 (epoch 2, mid-epoch): the agent
       restarts the workers from step 12's checkpoint, and they replay steps 13-15.
    """
    seen: dict = {"run": tmp_path_factory.mktemp("continued") / "run"}
    run, marker = seen["run"], uuid.uuid4().hex
    argv = (*JOB, "--run-dir", str(run), "--max-restarts", "2")
    proc = _start(*argv, env=_env(DDPKIT_TEST_SLEEP_AT_STEP="5:*:120", **{MARKER: marker}))
    try:
        _wait_for("checkpoints/step_000000004/manifest.json", proc, run)
        while worker_pid(marker, 1) is None:  # both workers up and parked after step 5
            assert proc.poll() is None, _finish(proc)[1][-3000:]
            time.sleep(0.1)
        seen["sockets"] = listening_sockets(marked(marker))
        seen["before"] = sorted(p.name for p in (run / "checkpoints").iterdir())
    finally:
        proc.kill()  # SIGKILL: no handler runs in the launcher
        proc.communicate()
    seen["gone"] = seconds_until_gone(marker, limit=10)
    time.sleep(1)
    seen["after"] = sorted(p.name for p in (run / "checkpoints").iterdir())

    proc = _start(*argv, env=_env(DDPKIT_TEST_SLEEP_AT_STEP="9:*:120"))
    _wait_for("checkpoints/step_000000008/manifest.json", proc, run)
    proc.send_signal(signal.SIGTERM)
    seen["stopped"] = _finish(proc, timeout=90)
    manifest = run / "checkpoints" / "step_000000009" / "manifest.json"
    seen["manifest"] = json.loads(manifest.read_text()) if manifest.exists() else None
    seen["summary_after_stop"] = (run / "summary.json").exists()

    seen["resumed"] = _train("--resume", str(run), "--collective-timeout", "6",
                             "--max-restarts", "1", DDPKIT_TEST_SLEEP_AT_STEP="12:1:2",
                             DDPKIT_TEST_KILL_AT_STEP="15:1")
    return seen


def test_killed_worker_is_restarted_and_the_run_ends_bit_identical(reference, continued):
    code, text = continued["resumed"]
    assert code == 0, text[-3000:]
    assert "exitcode: -9" in text  # the agent saw the SIGKILL...
    assert "resumed at step 12 (epoch 2" in text  # ...and restarted
    run = continued["run"]
    _assert_ends_like(run, reference)


@pytest.mark.chaos
def test_killed_launcher_and_sigterm_each_end_and_the_same_command_continues(
        reference, continued):
    run = continued["run"]
    # 1. Exposure: a single-node run listens on loopback only (stores and gloo alike).
    sockets = continued["sockets"]
    assert sockets and all(is_loopback(s) for s in sockets), sockets
    gone = continued["gone"]
    assert gone is not None and gone < 5, "workers outlived their launcher"
    assert continued["after"] == continued["before"]  # no headless writer

    # 2. The same command line continued the run; SIGTERM stopped it with a checkpoint.
    code, text = continued["stopped"]
    assert code == EXIT_PREEMPTED, text[-3000:]
    assert f"--run-dir {run} holds this run, stopped at step 4: continuing it" in text
    assert continued["manifest"] is not None and continued["manifest"]["reason"] == "preempted"
    assert f"continue with: ddpkit train --resume {run}" in text
    assert not continued["summary_after_stop"]  # the run is not over

    # 3. --resume continued from the preemption's checkpoint, to the uninterrupted bits.
    code, text = continued["resumed"]
    assert code == 0, text[-3000:]
    assert "resumed at step 9 (epoch 1, sample 288 of 300)" in text, text[-3000:]
    _assert_ends_like(run, reference)


@pytest.mark.chaos
def test_full_disk_at_a_checkpoint_is_one_line_no_restart_and_no_debris(tmp_path):
    if not can_mount():
        skip_unless_required("needs root to mount a small tmpfs")
    job = [a for a in JOB if a != "--log-sample-ids"]  # per-step logs would fill it first
    with small_filesystem(16) as disk:
        run = disk / "run"
        proc = _start(*job, "--run-dir", str(run), "--max-restarts", "2",
                      env=_env(DDPKIT_TEST_SLEEP_AT_STEP="5:*:5"))
        _wait_for("checkpoints/step_000000004/manifest.json", proc, run)
        fill(disk)  # the next write is step 8's checkpoint
        code, text = _finish(proc)
        assert code == EXIT_DISK_FULL, text[-3000:]
        errors = [line for line in text.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, text[-3000:]
        assert re.search(rf"ddpkit train: error: no space left on device to write "
                         rf"{run}/checkpoints/step_000000008: it needs [\d,]+ bytes, "
                         rf"[\d,]+ bytes free there; free some space there, then continue "
                         rf"the run: ddpkit train --resume {run}$", errors[0]), errors[0]
        assert "Traceback" not in text and not FRAME_DUMP.search(text)
        assert text.count("run directory:") == 1  # --max-restarts 2 did not restart into it
        debris = [p.name for p in run.rglob("*") if ".tmp" in p.name]
        assert debris == [] and not (run / "summary.json").exists()
        assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_000000004"]


# The default job (digits, MLP 128: model.pt ~40 KB, each rank's DCP file ~51 KB,
# curves.png ~56 KB; tmpfs counts whole 4 KiB pages) on a tmpfs of each size, so that the
# first write that finds the disk full is, in turn, each writer's: (size KiB, options,
# the file the error must name, what it must say to do, {run} the run directory).
RESUME = "free some space there, then continue the run: ddpkit train --resume {run}"
REMOVE = ("free some space there, remove {run} (it holds no checkpoint to continue from) "
          "and start the run again")
AGAIN = "free some space there and start the run again"
WRITERS = {
    # the lock file takes the one page; the trainer is not built yet
    "probe": (4, [], r"checkpoints", "free some space there and run the same command again"),
    "config": (4, ["--no-checkpoints"], r"config\.json", AGAIN),
    "run-log": (8, [], r"(train\.log|metrics\.jsonl)", REMOVE),
    "sample-ids": (16, ["--log-sample-ids"], r"sample_ids/rank[01]\.jsonl", REMOVE),
    "dcp-parts": (64, [], r"checkpoints/step_000000012", REMOVE),
    "dcp-parts-later": (200, [], r"checkpoints/step_000000024", RESUME),  # after step 12's
    "model": (40, ["--no-checkpoints"], r"model\.pt", AGAIN),
    "curves": (80, ["--no-checkpoints"], r"(summary\.json|curves\.png)", AGAIN),
}
DEFAULT_JOB = ["--nproc-per-node", "2", "--epochs", "2", "--threads", "1", "--no-progress"]


def _debris(root: Path) -> list[str]:
    """What a failed write must not leave: temporaries, checkpoint directories without
    their manifest, files cut short (a JSON file or a log line that does not parse)."""
    left = []
    for path in root.rglob("*"):
        unfinished = path.is_dir() and path.name.startswith("step_") and not (
            path / "manifest.json").exists()
        if ".tmp" in path.name or unfinished:
            left.append(str(path))
        elif path.suffix == ".json":
            try:
                json.loads(path.read_text())
            except ValueError:
                left.append(str(path))
        elif path.suffix == ".jsonl" and not path.read_text().endswith("\n"):
            left.append(str(path))  # half a line (an empty log is never created)
    return left


@pytest.fixture(scope="module")
def full_disk_runs():
    """writer -> (its tmpfs, exit code, output) of the default job on that writer's tmpfs.
    The launches are independent (a tmpfs each), so they run a few at a time: most of a
    launch is its processes starting. The tmpfs stay mounted until the module ends."""
    import contextlib

    runs: dict[str, tuple[Path, int, str]] = {}
    with contextlib.ExitStack() as mounts:
        writers = sorted(WRITERS)
        for wave in (writers[:4], writers[4:]):
            started = []
            for writer in wave:
                size_kib, options, _, _ = WRITERS[writer]
                disk = mounts.enter_context(small_filesystem_or_skip(size_kib))
                started.append((writer, disk, _start(
                    *DEFAULT_JOB, *options, "--out-dir", str(disk / "out"),
                    "--max-restarts", "2", env=_env())))
            for writer, disk, proc in started:
                runs[writer] = (disk, *_finish(proc))
        yield runs


@pytest.mark.chaos
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_full_disk_in_any_writer_is_one_line_and_final(full_disk_runs, writer):
    _, _, named, advice = WRITERS[writer]
    disk, code, text = full_disk_runs[writer]
    out = disk / "out"
    assert code == EXIT_DISK_FULL, text[-3000:]
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, text[-3000:]
    assert re.search(rf"ddpkit train: error: no space left on device (to write|writing "
                     rf"in) {out}/[^ ]+/{named}\b.*[\d,]+ bytes( \([\d.]+ MiB\))? free "
                     rf"there", errors[0]), errors[0]
    (run,) = out.iterdir()
    assert errors[0].endswith(advice.format(run=run)), errors[0]
    assert "Traceback" not in text and not FRAME_DUMP.search(text)
    assert text.count("run directory:") <= 1  # --max-restarts 2 did not restart into it
    assert "restart" not in text.lower(), text[-3000:]
    assert _debris(disk) == []


@pytest.mark.chaos
def test_a_stopped_rank_is_named_within_the_timeout_and_every_process_ends(tmp_path):
    marker, timeout, margin = uuid.uuid4().hex, 3.0, 3.0
    proc = _start(*JOB, "--out-dir", str(tmp_path), "--collective-timeout", str(timeout),
                  env=_env(DDPKIT_TEST_SLEEP_AT_STEP="5:*:2", **{MARKER: marker}))
    # Rank 1 logged step 5's samples: it is past step 4's checkpoint (whose manifest rank
    # 0 may write before rank 1 leaves it) and in its 2 s sleep before step 5's check.
    _wait_for_step_line(5, 1, proc, tmp_path)
    stopped = worker_pid(marker, 1)
    assert stopped is not None
    os.kill(stopped, signal.SIGSTOP)
    code, text = _finish(proc, timeout=120)
    # The agent's SIGTERM takes effect in the stopped rank (continued by the launcher),
    # instead of the agent waiting out its 30 s grace period and killing it.
    assert "Unable to shutdown process" not in text, text[-3000:]
    assert code == EXIT_HANG, text[-3000:]
    found = re.search(r"ddpkit train: error: rank 0 waited ([\d.]+) s at step 5 'step_check' "
                      r"\(timeout 3 s\) for rank 1 \(last at step 5 ", text)
    assert found, text[-3000:]
    assert float(found.group(1)) <= timeout + margin
    assert "Traceback" not in text and not FRAME_DUMP.search(text)
    gone = seconds_until_gone(marker, limit=10)
    assert gone is not None and gone < 2
