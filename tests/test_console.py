"""The launcher's console: rank 0's progress reaches the launcher through a file and is
drawn as a live status line on a terminal, as plain periodic lines otherwise."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys

from conftest import ROOT
from ddpkit.console import Console, describe

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_console_on_a_terminal_redraws_one_status_line_below_the_output():
    out, err = io.StringIO(), io.StringIO()
    console = Console(stdout=out, stderr=err, tty=True)
    record = {"step": 12, "total_steps": 48, "epoch": 2, "epochs": 8, "samples_per_s": 1234.5,
              "loss": 0.5}
    console.show({**record, "step": 0}, now=0.0)
    console.show(record, now=3.0)  # 12 steps in 3 s: 36 left take 9 s
    status = "epoch 2/8 | step 12/48 (25%) | 1,234 samples/s | loss 0.5000 | ETA 9s"
    assert err.getvalue().endswith("\r\x1b[K" + status)
    console.write(out, "[default0]:hello\n")
    # The status is cleared before the line and drawn again after it.
    assert err.getvalue().endswith("\r\x1b[K" + status + "\r\x1b[K" + status)
    assert out.getvalue() == "[default0]:hello\n"
    console.close()
    assert err.getvalue().endswith("\r\x1b[K")


def test_console_off_a_terminal_prints_a_line_per_n_steps_with_a_real_eta():
    err = io.StringIO()
    console = Console(stdout=io.StringIO(), stderr=err, tty=False, every_steps=10)
    for t in (0.0, 4.0, 9.0, 10.5, 12.0, 21.0, 25.0, 30.0):  # one step per second
        console.show({"step": int(t), "total_steps": 30, "epoch": 1, "epochs": 1,
                      "samples_per_s": 100.0, "loss": 1.0}, now=t)
    lines = err.getvalue().splitlines()
    assert [line.split(" | ")[1] for line in lines] == [
        "step 10/30 (33%)", "step 21/30 (70%)", "step 30/30 (100%)"]
    # 10 steps took 10.5 s: 20 more take 21 s
    assert [line.split(" | ")[-1] for line in lines] == ["ETA 21s", "ETA 9s", "ETA 0s"]
    assert all(line.startswith("progress: epoch 1/1") and "samples/s" in line
               for line in lines)
    assert "\r" not in err.getvalue() and "ETA ?" not in err.getvalue()


def test_plain_lines_default_to_a_tenth_of_the_run_and_prefer_rank_0s_eta():
    err = io.StringIO()
    console = Console(stdout=io.StringIO(), stderr=err, tty=False)
    console.every_steps = 0  # whatever the environment says
    for step in range(0, 101, 5):
        console.show({"step": step, "total_steps": 100, "eta_s": 100.0 - step}, now=step)
    lines = err.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("progress: step 10/100")
    assert lines[0].endswith("ETA 1m30s") and lines[-1].endswith("ETA 0s")
    assert describe({"step": 3}, None) == "step 3 | ETA ?"  # a terminal's first redraw
    assert describe({"step": 3, "peak_rss_mib": [412, 405]}, None) == (
        "step 3 | peak RSS 412/405 MiB | ETA ?")


def _train(tmp_path, *argv, **env):
    return subprocess.run(
        [sys.executable, "-m", "ddpkit.cli", "train", "--out-dir", str(tmp_path), *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
        env={**os.environ, "PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1", **env})


def test_train_users_factories_with_progress_lines_when_not_a_terminal(tmp_path):
    """`ddpkit train --model pkg.mod:factory --data pkg.mod:factory` end to end; its
    progress, off a terminal, is plain `progress:` lines from the launcher."""
    proc = _train(tmp_path, "--model", "user_recipe:make_model", "--data",
                  "user_recipe:make_data", "--epochs", "4", "--batch-size", "32",
                  "--optimizer", "adamw", "--lr", "0.01", "--lr-schedule", "cosine",
                  DDPKIT_PROGRESS_EVERY_STEPS="4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    assert run.name.endswith("-make_data-make_model-w2")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "user_recipe:make_model" and summary["final_test_acc"] > 0.9
    progress = [line for line in proc.stderr.splitlines() if line.startswith("progress: ")]
    assert progress, proc.stderr[-3000:]
    assert re.fullmatch(r"progress: epoch 4/4 \| step 32/32 \(100%\) \| [\d,]+ samples/s \| "
                        r"loss \d+\.\d{4} \| peak RSS \d+/\d+ MiB \| ETA 0s", progress[-1]), \
        progress[-1]
    assert all(re.search(r"\| ETA \d+(s|m\d\ds)$", line) for line in progress), progress
    steps = [int(re.search(r"step (\d+)/", line).group(1)) for line in progress]
    assert steps == sorted(steps) and all(b - a >= 4 for a, b in zip(steps, steps[1:])), steps
    assert "\r" not in proc.stderr


def test_train_progress_is_one_live_line_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit.cli", "train", "--out-dir", str(tmp_path), "--data",
         "synthetic", "--synthetic-size", "512", "--epochs", "3", "--hidden", "16"],
        stdout=subprocess.DEVNULL, stderr=slave, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the other end closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    text = b"".join(chunks).decode(errors="replace")
    drawn = re.findall(r"\r\x1b\[K(epoch \d/3 \| step \d+/12 [^\r\n]*)", text)
    assert drawn and "step 12/12 (100%)" in drawn[-1], text[-2000:]
    assert "progress: " not in text  # no plain lines on a terminal
    # Worker lines still arrive whole, prefixed, and the status is cleared at the end.
    assert "[default0]:" in text and "done: test accuracy" in text
    assert text.endswith("\r\x1b[K")
