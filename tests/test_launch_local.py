"""The direct launcher (one node, no restarts) and the launcher's console.

`ddpkit train` starts its workers without torchrun's agent and without importing torch
itself; each worker gets torchrun's environment, its lines come back prefixed, a failing
rank is named in one line. Rank 0's progress reaches the launcher through a file and is
drawn as a live status line on a terminal, as plain periodic lines otherwise.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import textwrap

from conftest import ROOT
from ddpkit.console import Console, describe
from ddpkit.launch import LaunchOptions, launch

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_the_launching_process_never_imports_torch(tmp_path):
    """Everything `ddpkit train` does before its workers start, without torch."""
    probe = textwrap.dedent(f"""
        import sys
        import ddpkit.launch_local as ll
        from ddpkit import cli
        seen = {{}}
        def fake(cmd, nproc, console):
            seen.update(cmd=cmd, nproc=nproc, torch="torch" in sys.modules)
            return 0, []
        ll.launch_local = fake
        code = cli.main(["train", "--epochs", "1", "--out-dir", {str(tmp_path)!r}])
        seen["torch_after"] = "torch" in sys.modules
        print(code, seen)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    code, seen = out.stdout.split(" ", 1)
    assert code == "0"
    seen = eval(seen)  # a dict literal we printed
    assert seen["nproc"] == 2 and "ddpkit.train.worker" in seen["cmd"]
    assert seen["torch"] is False and seen["torch_after"] is False


SCRIPT = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "DDPKIT_PROGRESS_FILE"]
print(json.dumps({k: os.environ.get(k) for k in keys}))
print("to stderr", file=sys.stderr)
if os.environ["RANK"] == sys.argv[1]:
    raise ValueError("boom-on-rank-" + sys.argv[1])
"""


def test_workers_get_torchruns_environment_and_prefixed_output(tmp_path, capsys):
    script = tmp_path / "env.py"
    script.write_text(SCRIPT)
    assert launch(str(script), ["-1"], LaunchOptions(nproc_per_node=3)) == 0
    out, err = capsys.readouterr()
    envs = {}
    for line in out.splitlines():
        prefix, _, payload = line.partition(":")
        envs[prefix] = json.loads(payload)
    assert sorted(envs) == ["[default0]", "[default1]", "[default2]"]
    for rank in range(3):
        env = envs[f"[default{rank}]"]
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("3", "3", "0")
        assert env["ROLE_NAME"] == "default" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["DDPKIT_PROGRESS_FILE"]
    assert len({e["MASTER_PORT"] for e in envs.values()}) == 1
    assert sorted(err.splitlines()) == [f"[default{r}]:to stderr" for r in range(3)]
    assert "DDPKIT_PROGRESS_FILE" not in os.environ  # the launcher's own env is restored


def test_a_failing_worker_is_named_once_and_the_others_are_stopped(tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    code = launch(str(script), ["1"], LaunchOptions(nproc_per_node=2))
    out, err = capsys.readouterr()
    assert code == 1
    assert err.count("ValueError: boom-on-rank-1") == 1
    assert re.search(r"ddpkit launch: rank 1 failed first \(exit code 1, pid \d+\); its "
                     r"traceback is above, prefixed \[default1\]$", err.strip()), err


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


def test_console_off_a_terminal_prints_plain_lines_at_its_interval():
    err = io.StringIO()
    console = Console(stdout=io.StringIO(), stderr=err, tty=False, interval=10)
    for t in (0.0, 4.0, 9.0, 10.5, 12.0, 21.0):
        console.show({"step": int(t), "total_steps": 30, "epoch": 1, "epochs": 1,
                      "samples_per_s": 100.0, "loss": 1.0}, now=t)
    lines = err.getvalue().splitlines()
    assert [line.split(" | ")[1] for line in lines] == [
        "step 0/30 (0%)", "step 10/30 (33%)", "step 21/30 (70%)"]
    assert all(line.startswith("progress: epoch 1/1") for line in lines)
    assert "\r" not in err.getvalue()
    assert describe({"step": 3}, None) == "step 3 | ETA ?"


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
                  DDPKIT_PROGRESS_INTERVAL="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    assert run.name.endswith("-make_data-make_model-w2")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "user_recipe:make_model" and summary["final_test_acc"] > 0.9
    progress = [line for line in proc.stderr.splitlines() if line.startswith("progress: ")]
    assert progress, proc.stderr[-3000:]
    assert re.fullmatch(r"progress: epoch 4/4 \| step 32/32 \(100%\) \| [\d,]+ samples/s \| "
                        r"loss \d+\.\d{4} \| ETA \S+", progress[-1]), progress[-1]
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
