"""`ddpkit slurm --launcher torchrun`: the multi-node tutorial's layout, simulated SLURM.

One task per node runs torchrun's agent (`ddpkit launch`); node 0 hosts the c10d
rendezvous; each node's agent restarts its workers. There is no SLURM here, so `srun` and
`scontrol` are stand-ins on PATH (the approach of tests/test_slurm.py): srun starts
SLURM_NNODES x SLURM_NTASKS_PER_NODE tasks on this host with SLURM's per-task variables
and relays signals to them; scontrol lists hostnames and records requeues. The
generated script, ddpkit launch, torchrun's agent and rendezvous are the real thing.
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
from ddpkit.launcher import torchrun_args
from ddpkit.launcher.slurm_script import AGENT_SIGNALS, SlurmJob, render, write
from test_multinode import TRAIN_ARGS, assert_same_training, reference_run

JOB_ID = "4343"
TIMEOUT_S = 180

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

# Stands in for the python that runs `ddpkit launch`: records what each task was given.
RECORD_TASK = r"""#!/usr/bin/env python3
import json, os, sys
out = os.path.join(os.environ["RECORD_DIR"], f"task{os.environ['SLURM_NODEID']}.json")
with open(out, "w") as f:
    json.dump({"argv": sys.argv[1:], "rdzv_conf": os.environ.get("PET_RDZV_CONF")}, f)
"""

# A worker: records every start; local rank 1 of node 0 fails its first attempt (its
# agent must restart, and the other node's agent follow); then every rank meets in a gloo
# barrier, as a training step would, and records the world it trained in.
PROBE = r"""
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
        "SLURM_NODEID", "MASTER_ADDR")
seen = {k: os.environ.get(k) for k in keys}
seen["argv"] = sys.argv[1:]
out = os.environ["PROBE_OUT"]
with open(os.path.join(out, f"start.{os.getpid()}.json"), "w") as f:
    json.dump(seen, f)
if (seen["SLURM_NODEID"], seen["LOCAL_RANK"], seen["TORCHELASTIC_RESTART_COUNT"]) == (
        "0", "1", "0"):
    sys.exit(7)
import datetime
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.barrier()
from ddpkit.runtime.world import World
world = World.from_env()
seen["world"] = {"rank": world.rank, "world_size": world.world_size, "source": world.source}
with open(os.path.join(out, f"trained.rank{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
"""

WAIT_FOR_USR1 = r"""
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
(out / f"ready.{os.environ['RANK']}").touch()
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"usr1.{os.environ['RANK']}").write_text("yes" if got else "timeout")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_slurm(tmp_path):
    """PATH with stand-in srun/scontrol, and the batch environment sbatch would give."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "scontrol.log"
    launcher_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "DDPKIT_CLI_LOGGING")
    base = {k: v for k, v in os.environ.items()
            if k not in launcher_vars and not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_"))}

    def env(nodes: int, **extra: str) -> dict[str, str]:
        # #SBATCH --ntasks-per-node=1: what the batch shell sees in this layout.
        return {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SCONTROL_LOG": str(log),
                "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "node[01-02]",
                "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": "1",
                "RDZV_PORT": str(free_port()),  # the script honours a given port
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}

    return env, log


def batch(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


# ------------------------------------------------------------------ the script itself
def test_script_directives_and_one_agent_per_node():
    job = SlurmJob(nodes=4, gpus_per_node=8, command=("train", "--epochs", "3"),
                   time="12:00:00", cpus_per_task=32, launcher="torchrun")
    text = render(job)
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=ddpkit", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=32", "#SBATCH --time=12:00:00",
        "#SBATCH --output=%x-%j.out", "#SBATCH --open-mode=append", "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120"]
    assert 'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert "MASTER_ADDR" not in text  # the agent of the rank-0 node hands it out
    assert "trap requeue USR1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert sum(line.startswith("srun ") for line in text.splitlines()) == 1
    proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr  # valid bash


def recorded_tasks(tmp_path, fake_slurm, job_args: dict, **env_extra) -> list[dict]:
    """Run the generated script with a recorder in place of the python that starts the
    agent: what every node's task was given, after the batch shell's expansion."""
    env_for, _ = fake_slurm
    recorder = tmp_path / "record_task"
    recorder.write_text(RECORD_TASK)
    recorder.chmod(0o755)
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    script = write(SlurmJob(python=str(recorder), launcher="torchrun", **job_args),
                   tmp_path / "job.sbatch")
    env = env_for(job_args["nodes"], RECORD_DIR=str(record_dir), **env_extra)
    proc = batch(script, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tasks = [json.loads(p.read_text()) for p in sorted(record_dir.glob("task*.json"))]
    for task in tasks:
        task["port"] = env["RDZV_PORT"]
    return tasks


def test_each_node_runs_the_agent_with_torchruns_meaning(tmp_path, fake_slurm):
    tasks = recorded_tasks(tmp_path, fake_slurm, dict(
        nodes=3, gpus_per_node=0, tasks_per_node=2, max_restarts=5,
        command=("train", "--epochs", "2", "--out-dir", str(tmp_path / "runs"))))
    assert len(tasks) == 3  # one task per node
    # node 0, the host scontrol lists first, hosts the store; the others are clients
    assert [t["rdzv_conf"] for t in tasks] == ["is_host=1", "is_host=0", "is_host=0"]
    argvs = {tuple(t["argv"]) for t in tasks}
    assert len(argvs) == 1  # the same command line on every node
    argv = list(argvs.pop())
    assert argv[:3] == ["-m", "ddpkit.cli", "launch"]
    args = torchrun_args.parse(argv[3:])  # read exactly as ddpkit launch reads it
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("3", "2", "c10d")
    assert args.rdzv_endpoint == f"localhost:{tasks[0]['port']}" and args.rdzv_id == JOB_ID
    assert args.max_restarts == 5 and "SIGUSR1" in args.signals_to_handle.split(",")
    assert args.signals_to_handle == AGENT_SIGNALS and args.shutdown_timeout == 120
    assert args.module and args.training_script == "ddpkit.train.worker"
    run_dir = f"{tmp_path / 'runs'}/slurm-job-{JOB_ID}"
    assert args.training_script_args == [
        "--epochs", "2", "--out-dir", str(tmp_path / "runs"), "--run-dir", run_dir]


def test_a_requeued_job_resumes_its_run_directory(tmp_path, fake_slurm):
    runs = tmp_path / "runs"
    checkpoints = runs / f"slurm-job-{JOB_ID}" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_000000004.json").write_text("{}")  # the previous attempt's
    tasks = recorded_tasks(tmp_path, fake_slurm, dict(
        nodes=2, gpus_per_node=0, tasks_per_node=1,
        command=("train", "--out-dir", str(runs))), SLURM_RESTART_COUNT="1")
    assert len(tasks) == 2  # one task per node
    for task in tasks:
        assert task["argv"][-2:] == ["--resume", str(runs / f"slurm-job-{JOB_ID}")]


def test_script_arguments_are_not_expanded_by_the_batch_shell(tmp_path, fake_slurm):
    script = tmp_path / "train.py"
    script.write_text("")
    tasks = recorded_tasks(tmp_path, fake_slurm, dict(
        nodes=1, gpus_per_node=0, tasks_per_node=1,
        command=(str(script), "--tag", "$HOME", "two words", "it's")))
    assert tasks[0]["argv"][-5:] == [str(script), "--tag", "$HOME", "two words", "it's"]


@pytest.mark.parametrize(("args", "message"), [
    (["--launcher", "mpirun"], "--launcher 'mpirun' is not one of srun, torchrun"),
    (["--max-restarts", "2"], "--max-restarts needs --launcher torchrun"),
    (["--launcher", "torchrun", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
])
def test_cli_rejects_bad_launcher_options_in_one_line(tmp_path, capsys, args, message):
    assert cli.main(["slurm", "--out", str(tmp_path / "x.sbatch"), "--nodes", "2",
                     "--gpus-per-node", "4", *args, "--", "train"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit slurm: error: ") and message in lines[0]
    assert not (tmp_path / "x.sbatch").exists()


def test_max_restarts_default_only_for_the_agent():
    assert SlurmJob(nodes=1, gpus_per_node=1, command=("train",), launcher="torchrun").restarts == 3
    with pytest.raises(ConfigError, match="needs --launcher torchrun"):
        SlurmJob(nodes=1, gpus_per_node=1, command=("train",), max_restarts=1)


# ------------------------------------------------- agents and workers, simulated SLURM
def test_two_nodes_rendezvous_and_a_failed_worker_is_restarted(tmp_path, fake_slurm):
    env_for, log = fake_slurm
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    script = write(SlurmJob(nodes=2, gpus_per_node=0, tasks_per_node=2, launcher="torchrun",
                            max_restarts=1, command=(str(probe), "--lr", "0.1")),
                   tmp_path / "job.sbatch")
    proc = batch(script, env_for(2, PROBE_OUT=str(out)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert log.read_text().splitlines() == ["show hostnames node[01-02]"]

    starts = [json.loads(p.read_text()) for p in out.glob("start.*.json")]
    failed = [s for s in starts if (s["SLURM_NODEID"], s["LOCAL_RANK"],
                                    s["TORCHELASTIC_RESTART_COUNT"]) == ("0", "1", "0")]
    assert len(failed) == 1 and len(starts) > 4  # a worker failed, and workers restarted
    trained = [json.loads((out / f"trained.rank{r}.json").read_text()) for r in range(4)]
    for r, s in enumerate(trained):
        assert (s["RANK"], s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["GROUP_WORLD_SIZE"]) == (
            str(r), "4", "2", "2")
        assert s["TORCHELASTIC_RUN_ID"] == JOB_ID and s["argv"] == ["--lr", "0.1"]
        # torchrun's variables win over the SLURM task's in World.from_env
        assert s["world"] == {"rank": r, "world_size": 4, "source": "torchrun"}
    # node 0's agent restarted its workers (attempt 1) after the failure
    assert {s["TORCHELASTIC_RESTART_COUNT"] for s in trained if s["SLURM_NODEID"] == "0"} == {
        "1"}
    # each node's workers share its group rank, and came from one SLURM task (node)
    groups = {}
    for s in trained:
        groups.setdefault(s["GROUP_RANK"], set()).add((s["SLURM_NODEID"], s["LOCAL_RANK"]))
    assert sorted(len(g) for g in groups.values()) == [2, 2]
    assert all(len({node for node, _ in g}) == 1 for g in groups.values())


def test_usr1_reaches_every_worker_through_the_agents_and_requeues(tmp_path, fake_slurm):
    env_for, log = fake_slurm
    worker = tmp_path / "wait_for_usr1.py"
    worker.write_text(WAIT_FOR_USR1)
    script = write(SlurmJob(nodes=2, gpus_per_node=0, tasks_per_node=1, launcher="torchrun",
                            command=(str(worker), str(tmp_path))), tmp_path / "job.sbatch")
    job = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env_for(2), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and job.poll() is None, "workers never started"
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does: the batch shell only
        _, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert [(tmp_path / f"usr1.{r}").read_text() for r in (0, 1)] == ["yes", "yes"], err[-3000:]
    assert f"requeue {JOB_ID}" in log.read_text().splitlines()
    assert f"checkpoint and requeue job {JOB_ID}" in err
    assert "ddpkit launch: got SIGUSR1; the workers were sent SIGUSR1" in err
    assert job.returncode == 128 + signal.SIGUSR1, err[-3000:]


def test_preempted_train_is_requeued_and_ends_like_one_uninterrupted_node(
        tmp_path, train_reference, fake_slurm):
    """USR1 mid-epoch: the agents pass it to the workers, which checkpoint and stop; the
    job asks for a requeue; the requeued job resumes its run directory and ends with an
    uninterrupted 1-node, 2-process run's model, bit for bit."""
    want = reference_run(train_reference)
    env_for, log = fake_slurm
    out = tmp_path / "runs"
    script = write(SlurmJob(nodes=2, gpus_per_node=0, tasks_per_node=1, launcher="torchrun",
                            command=("train", *TRAIN_ARGS, "--checkpoint-every-steps", "4",
                                     "--out-dir", str(out))),
                   tmp_path / "train.sbatch")
    env = env_for(2)
    job = subprocess.Popen(["bash", str(script)], cwd=ROOT, text=True,
                           env={**env, "DDPKIT_TEST_SLEEP_AT_STEP": "5:*:120"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not list(out.glob("*/checkpoints/step_000000004/manifest.json")):
            assert time.monotonic() < deadline and job.poll() is None, "no checkpoint appeared"
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # to the batch shell only, as --signal=B:USR1 does
        _, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 128 + signal.SIGUSR1, err[-3000:]
    assert f"requeue {JOB_ID}" in log.read_text().splitlines()
    run = out / f"slurm-job-{JOB_ID}"
    manifest = run / "checkpoints" / "step_000000005" / "manifest.json"
    assert json.loads(manifest.read_text())["reason"] == "preempted"

    env["RDZV_PORT"] = str(free_port())
    proc = batch(script, {**env, "SLURM_RESTART_COUNT": "1"})  # what SLURM sets
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed at step 5" in proc.stdout + proc.stderr
    assert_same_training(out, want)


def test_plain_srun_layout_is_still_the_default():
    text = render(SlurmJob(nodes=2, gpus_per_node=4, command=("train",)))
    assert "#SBATCH --ntasks-per-node=4" in text and "ddpkit.cli launch" not in text
    assert f"{sys.executable} -m ddpkit.cli train" in text
