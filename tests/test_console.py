"""The launcher's console: rank 0's progress reaches the launcher through a file and is
drawn as a live status line on a terminal, as plain periodic lines otherwise; on a
terminal `ddpkit train` prints lines for a person, none wider than 100 columns."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

from conftest import ROOT
from ddpkit.launcher import console as console_mod
from ddpkit.launcher.console import MAX_COLUMNS, Console, columns, progress_text

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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_rank_0s_lines_lose_the_tee_prefix_and_other_ranks_keep_theirs():
    term, piped = _Terminal(), io.StringIO()
    console = Console(stdout=term, stderr=term, tty=True, plain_prefix="[default0]:")
    console.write(term, "[default0]:epoch 1/2: train loss 0.5\n[default1]:Traceback\n")
    console.write(piped, "[default0]:to a file\n")  # not a terminal: every prefix stays
    assert term.getvalue() == "epoch 1/2: train loss 0.5\n[default1]:Traceback\n"
    assert piped.getvalue() == "[default0]:to a file\n"
    kept = _Terminal()
    Console(stdout=kept, stderr=kept, tty=True).write(kept, "[default0]:ddpkit launch\n")
    assert kept.getvalue() == "[default0]:ddpkit launch\n"  # without plain_prefix


def test_the_status_line_fits_the_terminal_and_never_exceeds_100_columns(monkeypatch):
    record = {"step": 5, "total_steps": 10, "epoch": 1, "epochs": 2, "samples_per_s": 1e6,
              "loss": 0.5, "peak_rss_mib": [1000 + r for r in range(64)], "eta_s": 1.0}
    assert progress_text(record, 1.0).count("peak RSS 1063 MiB") == 1  # the highest rank's
    for width, fits in ((300, MAX_COLUMNS), (60, 60)):
        monkeypatch.setattr(console_mod.os, "get_terminal_size",
                            lambda fd, w=width: os.terminal_size((w, 24)))
        assert columns() == fits
        err = io.StringIO()
        console = Console(stderr=err, tty=True)
        console.show({**record, "epochs": 10**60}, now=1.0)  # a status far too long
        assert 0 < len(err.getvalue().split("\r\x1b[K")[-1]) == fits - 1


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
    assert progress_text({"step": 3}, None) == "step 3 | ETA ?"  # a terminal's first redraw
    assert progress_text({"step": 3, "peak_rss_mib": [405, 412]}, None) == (
        "step 3 | peak RSS 412 MiB | ETA ?")


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
                        r"loss \d+\.\d{4} \| peak RSS \d+ MiB \| ETA 0s", progress[-1]), \
        progress[-1]
    assert all(re.search(r"\| ETA \d+(s|m\d\ds)$", line) for line in progress), progress
    steps = [int(re.search(r"step (\d+)/", line).group(1)) for line in progress]
    assert steps == sorted(steps) and all(b - a >= 4 for a, b in zip(steps, steps[1:])), steps
    assert "\r" not in proc.stderr


def _on_a_terminal(argv: list[str], columns: int, cwd: Path) -> tuple[int, str]:
    """Run ``ddpkit ARGV`` in ``cwd`` with stdout and stderr on a pseudo-terminal
    ``columns`` wide; its exit code and everything it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_")}
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit.cli", *argv], stdout=slave,
                            stderr=slave, stdin=subprocess.DEVNULL, cwd=cwd,
                            env={**env, "OMP_NUM_THREADS": "1"})
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
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def test_train_on_a_terminal_prints_lines_for_a_person_and_one_live_line(tmp_path):
    """What a newcomer sees: every line within 100 columns on a wider terminal, rank 0's
    lines without the launcher's prefix, the clock or the level; the per-rank detail in
    the run's train.log; the progress as one status line redrawn in place. (Run where a
    newcomer runs it, its runs/ under the current directory: a path longer than a line
    is printed whole, never cut.)"""
    code, text = _on_a_terminal(
        ["train", "--data", "synthetic", "--synthetic-size", "512", "--epochs", "3",
         "--hidden", "16"], columns=120, cwd=tmp_path)
    assert code == 0, text[-3000:]
    drawn = re.findall(r"\r\x1b\[K(epoch \d/3 \| step \d+/12 [^\r\n]*)", text)
    assert drawn and "step 12/12 (100%)" in drawn[-1], text[-2000:]
    assert "progress: " not in text  # no plain lines on a terminal
    assert text.endswith("\r\x1b[K")  # the status is cleared at the end
    # Every stretch of text the terminal shows on one row (between \r and \n).
    rows = [part.replace("\x1b[K", "") for line in text.split("\r\n") for part in
            line.split("\r")]
    assert max(len(row) for row in rows) <= 100, max(rows, key=len)
    (run_dir,) = (tmp_path / "runs").iterdir()
    epochs = [row for row in rows if row.startswith("epoch ") and ": train loss" in row]
    assert [row.split(":")[0] for row in epochs] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert "done: test accuracy" in text
    assert f"run directory: {run_dir.relative_to(tmp_path)}" in text
    assert "[default" not in text and "[rank 0]" not in text and " INFO " not in text
    assert not [row for row in rows if re.match(r"\d\d:\d\d:\d\d ", row)]
    assert "by rank" not in text  # the per-rank detail is in the run's log instead
    log = (run_dir / "train.log").read_text().splitlines()
    assert len(log) == 3 and all(re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d epoch \d/3: train loss .* \| "
        r"loss by rank \[\d+\.\d{4}, \d+\.\d{4}\] \| peak RSS by rank \[\d+, \d+\] MiB",
        line) for line in log), log
    # the terminal's epoch line, then the detail
    assert all(line.split(" ", 2)[2].startswith(row + " | loss by rank [")
               for row, line in zip(epochs, log, strict=True)), (epochs, log)
