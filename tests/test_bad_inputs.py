"""Bad input to `ddpkit train` (docs/bad-inputs.md): one line, exit 2, nothing started,
nothing in an existing run directory changed. All caught before any process launches,
so these run in-process."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit import cli
from ddpkit.runtime.world import World
from ddpkit.train.config import Config, resolve
from ddpkit.train.resume import check_resumable

RUN = {"data": "synthetic", "synthetic_size": 200, "batch_size": 32, "epochs": 1,
       "hidden": [8], "threads": 1, "progress": False, "checkpoint_every_steps": 3}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A finished one-process run (checkpoints at steps 3, 6 and 7), made in-process
    without a process group."""
    from ddpkit.train.trainer import Trainer

    run = tmp_path_factory.mktemp("small") / "run"
    cfg = resolve(RUN)
    Trainer(cfg, World(), run_dir=run, wrap=lambda module, engine, device: module).fit()
    return run


@pytest.fixture
def run_copy(small_run, tmp_path) -> Path:
    return Path(shutil.copytree(small_run, tmp_path / "run"))


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _fails_in_one_line(capsys, argv: list[str], *needles: str) -> str:
    code = cli.main(["train", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("ddpkit train: error: "), err
    for needle in needles:
        assert needle in last, last
    return err


# ---------------------------------------------------------------- data, config, output
@pytest.mark.parametrize("layout,needle", [
    ("missing", "not a directory"),
    ("a_file", "not a directory"),
    ("empty", "MNIST file train-images-idx3-ubyte (or train-images-idx3-ubyte.gz) not found"),
    ("unreadable", "train-images-idx3-ubyte.gz is not a valid IDX file (cannot read it"),
])
def test_unreadable_data_dir(capsys, tmp_path, layout, needle):
    data = tmp_path / "mnist"
    if layout == "a_file":
        data.write_text("not a directory")
    elif layout in ("empty", "unreadable"):
        data.mkdir()
    if layout == "unreadable":
        for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                     "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
            (data / f"{stem}.gz").write_bytes(b"this is not gzip")
    out = tmp_path / "runs"
    _fails_in_one_line(capsys, ["--data", "mnist", "--data-dir", str(data), "--model", "net",
                                "--out-dir", str(out)], needle)
    assert not out.exists() or not any(out.iterdir())  # no run directory was made


@pytest.mark.parametrize("argv,needle", [
    (["--checkpoint-every-steps", "0"], "--checkpoint-every-steps must be >= 1, got 0"),
    (["--checkpoint-every-seconds", "-5"], "--checkpoint-every-seconds must be > 0, got -5.0"),
    (["--keep", "0"], "--keep must be >= 1 (checkpoints kept), got 0"),
    (["--collective-timeout", "0"], "--collective-timeout must be > 0 seconds, got 0.0"),
    (["--lr", "0"], "--lr must be > 0 and finite, got 0.0"),
    (["--hidden", "0"], "--hidden must be positive integers, got [0]"),
    (["--lr", "inf"], "--lr must be > 0 and finite, got inf"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    pytest.param(["--precision", "fp16"], "--precision fp16 needs CUDA (its GradScaler) and "
                 "this machine has no usable CUDA GPU: use --precision bf16",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")),
])
@pytest.mark.parametrize("where", ["out_dir", "run_dir"])
def test_invalid_config_values(capsys, tmp_path, argv, needle, where):
    out = tmp_path / "runs"
    flag = "--out-dir" if where == "out_dir" else "--run-dir"
    _fails_in_one_line(capsys, [flag, str(out), *argv], needle)
    assert not out.exists()  # found before any directory was made


def test_config_file_that_is_not_utf8_is_one_line(capsys, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_bytes("[optim]\nlr = 0.1 # caf\u00e9\n".encode("latin-1"))
    _fails_in_one_line(capsys, ["--config", str(toml), "--out-dir", str(tmp_path / "runs")],
                       f"--config {toml}: not UTF-8 text (byte 0xe9 at offset 22)",
                       "save it as UTF-8")


def test_invalid_value_in_config_file(capsys, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[checkpoint]\nkeep = \"all\"\n")
    _fails_in_one_line(capsys, ["--config", str(toml)], "checkpoint.keep must be an integer")


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_unwritable_output_dir(capsys, tmp_path, where):
    (tmp_path / "afile").write_text("x")
    out = "/proc/ddpkit-runs" if where == "proc" else str(tmp_path / "afile" / "runs")
    _fails_in_one_line(capsys, ["--out-dir", out], f"--out-dir {out}: cannot create it")
    assert (tmp_path / "afile").read_text() == "x"


def test_run_dir_that_holds_a_finished_run_is_not_reused(capsys, small_run):
    before = _snapshot(small_run)
    _fails_in_one_line(capsys, ["--run-dir", str(small_run)], "holds a finished run",
                       "choose a new directory")
    assert _snapshot(small_run) == before


@pytest.mark.parametrize("what,needle", [
    ("a_file", "is a file, not a directory; give the path of a new directory"),
    ("other_files", "holds files that are not a run of ddpkit train"),
    ("no_checkpoint", "stopped before its first checkpoint, so there is nothing to continue"),
])
def test_run_dir_that_cannot_be_continued_is_one_line(capsys, run_copy, tmp_path, what, needle):
    target = {"a_file": tmp_path / "afile", "other_files": tmp_path / "other",
              "no_checkpoint": run_copy}[what]
    if what == "a_file":
        target.write_text("not a run")
    elif what == "other_files":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    else:
        shutil.rmtree(run_copy / "checkpoints")
        (run_copy / "summary.json").unlink()
    before = _snapshot(tmp_path)
    err = _fails_in_one_line(capsys, ["--run-dir", str(target)], needle)
    assert "--resume" not in err  # nothing there to resume
    assert _snapshot(tmp_path) == before


def test_run_dir_of_a_stopped_run_with_other_settings_names_them(capsys, run_copy):
    (run_copy / "summary.json").unlink()  # as a run stopped before its end leaves it
    before = _snapshot(run_copy)
    _fails_in_one_line(capsys, ["--run-dir", str(run_copy), "--hidden", "64"],
                       "was written with other settings", "model.hidden: [8] -> [64]")
    assert _snapshot(run_copy) == before


def test_a_run_dir_in_use_is_refused_naming_its_holder(capsys, run_copy):
    from ddpkit.files.run_lock import RunLock

    with RunLock.acquire(run_copy, command="ddpkit train (the first)"):
        before = _snapshot(run_copy)
        _fails_in_one_line(capsys, ["--resume", str(run_copy)],
                           f"run directory {run_copy} is in use by ddpkit train (the first) "
                           f"(pid {os.getpid()} on host {socket.gethostname()}, since ",
                           "wait for it to end, or stop it first")
        assert _snapshot(run_copy) == before
    assert not (run_copy / ".ddpkit-lock").exists()  # released and removed


def test_a_run_that_finishes_while_the_same_command_starts_is_not_continued(
        capsys, run_copy, monkeypatch):
    # The first command still held the lock when the second looked at the directory, and
    # finished before the second took it.
    from ddpkit.files.run_lock import RunLock

    summary = (run_copy / "summary.json").read_text()
    (run_copy / "summary.json").unlink()  # still going
    real_acquire = RunLock.acquire

    def first_finishes_meanwhile(run_dir, *args, **kwargs):
        (run_copy / "summary.json").write_text(summary)
        return real_acquire(run_dir, *args, **kwargs)

    monkeypatch.setattr(RunLock, "acquire", first_finishes_meanwhile)
    _fails_in_one_line(capsys, ["--run-dir", str(run_copy)], "holds a finished run")
    assert not (run_copy / ".ddpkit-lock").exists()  # released


def test_a_stale_lock_of_a_dead_holder_is_taken_over(run_copy):
    from ddpkit.files.run_lock import LOCK_FILE, RunLock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (run_copy / LOCK_FILE).write_text(
        json.dumps({"host": socket.gethostname(), "pid": int(dead), "command": "crashed"}))
    with RunLock.acquire(run_copy) as lock:  # flock died with its holder: nothing to wait for
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("argv,needle", [
    (["--hidden", "64"], "model.hidden: [8] -> [64]"),
    (["--model", "toy"], "model.name: 'mlp' -> 'toy'"),
    (["--lr", "0.5", "--seed", "3"], "optim.lr: 0.1 -> 0.5; train.seed: 1234 -> 3"),
])
def test_resume_with_other_model_or_settings_names_them(capsys, small_run, argv, needle):
    before = _snapshot(small_run)
    _fails_in_one_line(capsys, ["--resume", str(small_run), *argv],
                       "was written with other settings", needle, "leave those options out")
    assert _snapshot(small_run) == before


def test_corrupt_latest_checkpoint_falls_back_with_a_warning(run_copy, caplog):
    newest = run_copy / "checkpoints" / "step_000000007" / "__0_0.distcp"
    newest.write_bytes(newest.read_bytes()[:-10])  # truncated
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        info = check_resumable(run_copy, resolve({}, base=_saved_config(run_copy)))
    assert info.step == 6
    assert "truncated" in caplog.text and "falling back to step_000000006 (" in caplog.text


def test_every_checkpoint_damaged_is_one_error(capsys, caplog, run_copy):
    for payload in (run_copy / "checkpoints").glob("step_*/__0_0.distcp"):
        payload.write_bytes(b"garbage")
    before = _snapshot(run_copy)
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        _fails_in_one_line(capsys, ["--resume", str(run_copy)],
                           "every checkpoint in", "is damaged", "nothing to resume")
    assert caplog.text.count("skipping checkpoint") == 3  # each one named in a warning first
    assert _snapshot(run_copy) == before


def test_resume_of_a_run_without_checkpoints(capsys, run_copy):
    shutil.rmtree(run_copy / "checkpoints")
    before = _snapshot(run_copy)
    _fails_in_one_line(capsys, ["--resume", str(run_copy)], "no checkpoint in",
                       "nothing to resume")
    assert _snapshot(run_copy) == before
    assert not (run_copy / "checkpoints").exists()


@pytest.mark.parametrize("what,needle", [
    ("missing", "no such directory"),
    ("not_a_run", "no config.json; is it a run directory of ddpkit train?"),
    ("latest_of_nothing", "--resume: no run with checkpoints under"),
])
def test_resume_of_something_that_is_not_a_run(capsys, tmp_path, what, needle):
    (tmp_path / "runs").mkdir()
    argv = {"missing": ["--resume", str(tmp_path / "nope")],
            "not_a_run": ["--resume", str(tmp_path / "runs")],
            "latest_of_nothing": ["--out-dir", str(tmp_path / "runs"), "--resume"]}[what]
    _fails_in_one_line(capsys, argv, needle)
    assert list((tmp_path / "runs").iterdir()) == []


def _saved_config(run: Path) -> dict:
    from ddpkit.train.resume import read_run_config

    return read_run_config(run)


def test_saved_config_round_trips():
    assert Config.from_dict(resolve(RUN).to_dict()).identity() == resolve(RUN).identity()


def test_resume_and_run_dir_together(capsys, small_run, tmp_path):
    _fails_in_one_line(capsys, ["--resume", str(small_run), "--run-dir", str(tmp_path / "d")],
                       "--resume and --run-dir: give one")
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------- at run time
def test_a_run_whose_loss_turns_non_finite_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    from ddpkit.checkpoint import Checkpointer, read_model_state
    from ddpkit.train.divergence import DivergedError
    from ddpkit.train.trainer import Trainer

    run = tmp_path / "run"
    cfg = resolve({**RUN, "epochs": 2, "checkpoint_every_steps": 2, "lr": 1e10})
    with pytest.raises(DivergedError, match=(
            r"^the training loss on rank 0 is nan at step 4 \(epoch 1\): the run diverged and "
            r"was stopped before saving; the last good checkpoint, .*/step_000000002, is "
            r"kept; start again with a lower --lr \(it is 1e\+10\) or with --clip-grad-norm$")):
        Trainer(cfg, World(), run_dir=run, wrap=lambda module, engine, device: module).fit()
    ckpt = Checkpointer(run / "checkpoints", create=False)
    assert [info.step for info in ckpt.checkpoints()] == [2]  # nothing saved from NaN
    weights = read_model_state(ckpt.latest().path)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (run / "summary.json").exists() and not (run / "model.pt").exists()


@pytest.mark.parametrize("error,code", [
    ("diverged", 65), ("disk_full", 74), ("user", 2)])
def test_worker_exit_codes_of_failures_a_restart_would_repeat(capfd, monkeypatch, error, code):
    from ddpkit.errors import ConfigError
    from ddpkit.files.durable import DiskFullError
    from ddpkit.train.divergence import DivergedError
    from ddpkit.train.entry import run_entry

    raised = {"diverged": DivergedError("the training loss on rank 0 is nan"),
              "disk_full": DiskFullError("runs/R/model.pt", 5000, 0),
              "user": ConfigError("--model x:y returned str")}[error]
    monkeypatch.setenv("LOCAL_RANK", "0")

    def body():
        raise raised

    assert run_entry("train", body) == code
    assert capfd.readouterr().err == f"ddpkit train: error: {raised}\n"
