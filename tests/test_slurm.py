"""`ddpkit slurm`: the generated sbatch script, and its worker side under a simulated SLURM.

No SLURM here, so `srun` and `scontrol` are small stand-ins on PATH that do what the real
ones do for this script: srun starts SLURM_NNODES x SLURM_NTASKS_PER_NODE tasks with the
per-task variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS) and relays
signals to them; scontrol lists hostnames and records requeues. Everything else (the
script, ddpkit train, World.from_env, gloo) is the real thing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from ddpkit import ConfigError, cli
from ddpkit.launcher.slurm_script import SlurmJob, render, time_limit_seconds, write
from test_multinode import (
    NODE_TIMEOUT_S,
    TRAIN_ARGS,
    assert_same_training,
    child_env,
    reference_run,
    world_lines,
)

EXAMPLE = str(Path(ROOT) / "examples" / "40_mpi_train.py")
JOB_ID = "4242"

FAKE_SRUN = r"""#!/bin/bash
# Stand-in for srun inside an allocation: every task on this host, SLURM's per-task variables.
while [[ "$1" == --* ]]; do shift; done
per_node=$SLURM_NTASKS_PER_NODE
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  for ((local = 0; local < per_node; local++)); do
    SLURM_NODEID=$node SLURM_LOCALID=$local SLURM_PROCID=$((node * per_node + local)) \
      SLURM_NTASKS=$((SLURM_NNODES * per_node)) "$@" &
    pids+=($!)
  done
done
trap 'kill -USR1 "${pids[@]}" 2>/dev/null' USR1
status=0
for pid in "${pids[@]}"; do
  while wait "$pid"; s=$?; kill -0 "$pid" 2>/dev/null; do :; done
  [ "$s" -ne 0 ] && status=$s
done
exit $status
"""

FAKE_SCONTROL = r"""#!/bin/bash
echo "$*" >> "$SCONTROL_LOG"
if [ "$1 $2" = "show hostnames" ]; then echo localhost; echo localhost; fi
"""

WAIT_FOR_USR1 = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
(out / f"ready.{os.environ['SLURM_PROCID']}").touch()
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"usr1.{os.environ['SLURM_PROCID']}").write_text("yes" if got else "timeout")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_slurm(tmp_path):
    """PATH with fake srun/scontrol, and the batch environment sbatch would give."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "scontrol.log"

    def env(nodes: int, tasks_per_node: int) -> dict[str, str]:
        return child_env(
            PATH=f"{bin_dir}:{os.environ['PATH']}", SCONTROL_LOG=str(log),
            SLURM_JOB_ID=JOB_ID, SLURM_JOB_NODELIST="node[01-02]", SLURM_NNODES=str(nodes),
            SLURM_NTASKS_PER_NODE=str(tasks_per_node),
            MASTER_PORT=str(free_port()),  # the script honours a given port (tests: a free one)
        )

    return env, log


def sbatch_here(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=NODE_TIMEOUT_S)


# ------------------------------------------------------------------ the script itself
@pytest.mark.unit
def test_script_directives_and_command(tmp_path):
    job = SlurmJob(nodes=4, gpus_per_node=8, command=("train", "--epochs", "3", "--lr", "0.2"),
                   time="12:00:00", partition="gpu", account="proj1", cpus_per_task=6)
    text = render(job)
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=ddpkit", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=6", "#SBATCH --time=12:00:00",
        "#SBATCH --partition=gpu", "#SBATCH --account=proj1", "#SBATCH --output=%x-%j.out",
        "#SBATCH --open-mode=append", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@120"]
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert "trap requeue USR1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK" in text
    assert (f'{sys.executable} -m ddpkit.cli train --epochs 3 --lr 0.2 --run-dir "$RUN_DIR" &'
            in text)
    assert 'RUN_DIR=runs/slurm-job-"$SLURM_JOB_ID"' in text  # a requeue finds its checkpoints
    proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr  # valid bash


@pytest.mark.unit
def test_never_overwrites_without_force(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text("precious\n")
    job = SlurmJob(nodes=1, gpus_per_node=2, command=("train",))
    with pytest.raises(ConfigError, match="already exists"):
        write(job, path)
    assert path.read_text() == "precious\n"
    write(job, path, force=True)
    assert path.read_text().startswith("#!/bin/bash") and os.access(path, os.X_OK)


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "0", "--gpus-per-node", "8", "--", "train"], "--nodes must be >= 1"),
    (["--nodes", "2", "--gpus-per-node", "0", "--", "train"], "need --ntasks-per-node"),
    (["--nodes", "2", "--gpus-per-node", "8", "--time", "1:30", "--", "train"],
     "leaves no room before the preemption warning"),
    (["--nodes", "2", "--gpus-per-node", "8", "--", "nope.py"], "does not exist"),
    (["--nodes", "2", "--gpus-per-node", "8", "--", "rm", "-rf"], "expected `-- train ARGS`"),
    (["--nodes", "2", "--gpus-per-node", "8"], "nothing to run"),
])
@pytest.mark.unit
def test_cli_rejects_bad_input_in_one_line(tmp_path, capsys, args, message):
    assert cli.main(["slurm", "--out", str(tmp_path / "x.sbatch"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit slurm: error: ") and message in lines[0]
    assert not (tmp_path / "x.sbatch").exists()


@pytest.mark.parametrize(("limit", "seconds"), [
    ("90", 5400), ("1:30", 90), ("2:00:00", 7200), ("1-00", 86400), ("1-02:03", 93780),
    ("1-02:03:04", 93784)])
@pytest.mark.unit
def test_time_limits(limit, seconds):
    assert time_limit_seconds(limit) == seconds


# ------------------------------------------------------- worker side, simulated SLURM
@pytest.mark.slow
def test_worker_world_from_slurm_variables(tmp_path, fake_slurm):
    env_for, log = fake_slurm
    script = write(SlurmJob(nodes=2, gpus_per_node=0, tasks_per_node=1,
                            command=(EXAMPLE, "--steps", "0")), tmp_path / "probe.sbatch")
    proc = sbatch_here(script, env_for(nodes=2, tasks_per_node=1))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    worlds = sorted(world_lines(proc.stdout), key=lambda w: w["rank"])
    assert worlds == [dict(rank=r, local_rank=0, world_size=2, local_world_size=1, node_rank=r,
                           nnodes=2, source="slurm") for r in (0, 1)]
    assert log.read_text().splitlines() == ["show hostnames node[01-02]"]


@pytest.mark.slow
def test_preempted_job_is_requeued_and_ends_like_one_uninterrupted_node(
        tmp_path, train_reference, fake_slurm):
    """USR1 mid-epoch (SLURM's warning): every rank checkpoints, the job exits 75 and asks
    for a requeue; the requeued job (SLURM_RESTART_COUNT=1) continues in the same run
    directory and ends with an uninterrupted 1-node, 2-process run's epochs, bit for bit."""
    want = reference_run(train_reference)
    env_for, log = fake_slurm
    out = tmp_path / "runs"
    script = write(SlurmJob(nodes=2, gpus_per_node=0, tasks_per_node=1,
                            command=("train", *TRAIN_ARGS, "--checkpoint-every-steps", "4",
                                     "--out-dir", str(out))),
                   tmp_path / "train.sbatch")
    env = env_for(nodes=2, tasks_per_node=1)
    batch = subprocess.Popen(["bash", str(script)], cwd=ROOT, text=True,
                             env={**env, "DDPKIT_TEST_SLEEP_AT_STEP": "5:*:120"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + NODE_TIMEOUT_S
        while not list(out.glob("*/checkpoints/step_000000004/manifest.json")):
            assert time.monotonic() < deadline and batch.poll() is None, "no checkpoint appeared"
            time.sleep(0.1)
        batch.send_signal(signal.SIGUSR1)  # to the batch shell only, as --signal=B:USR1 does
        _, err = batch.communicate(timeout=NODE_TIMEOUT_S)
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()
    assert batch.returncode == 75, err[-3000:]
    assert f"requeue {JOB_ID}" in log.read_text().splitlines()
    run = out / f"slurm-job-{JOB_ID}"
    manifest = run / "checkpoints" / "step_000000005" / "manifest.json"
    assert json.loads(manifest.read_text())["reason"] == "preempted"

    proc = sbatch_here(script, {**env, "SLURM_RESTART_COUNT": "1"})  # what SLURM sets
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed at step 5" in proc.stdout + proc.stderr
    assert_same_training(out, want)


def test_usr1_reaches_workers_and_requeues(tmp_path, fake_slurm):
    env_for, log = fake_slurm
    worker = tmp_path / "wait_for_usr1.py"
    worker.write_text(WAIT_FOR_USR1)
    script = write(SlurmJob(nodes=2, gpus_per_node=0, tasks_per_node=1,
                            command=(str(worker), str(tmp_path))), tmp_path / "job.sbatch")
    batch = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env_for(2, 1),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and batch.poll() is None, "workers never started"
            time.sleep(0.05)
        batch.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does: the batch shell only
        _, err = batch.communicate(timeout=60)
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()
    assert batch.returncode == 0, err
    assert [(tmp_path / f"usr1.{r}").read_text() for r in (0, 1)] == ["yes", "yes"]
    assert f"requeue {JOB_ID}" in log.read_text().splitlines()
    assert f"checkpoint and requeue job {JOB_ID}" in err
