"""SLURM batch scripts for ddpkit jobs: one task per GPU, World from SLURM's variables.

Why one task per GPU (``srun`` starts every worker) rather than one launcher per node:

* ``ddpkit train`` and every program that calls ``ddpkit.init()`` already read
  ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``/``SLURM_NNODES`` (``World.from_env``),
  so no second process manager sits between SLURM and the workers: SLURM starts, signals
  and kills each of them (``--kill-on-bad-exit``), and its accounting sees every rank.
* Rank 0 is SLURM task 0, which SLURM places on the first node of the allocation, the
  same host ``scontrol show hostnames`` lists first: MASTER_ADDR points at rank 0's own
  store, with no rendezvous round and no node-ordering surprise.
* Preemption is SLURM's job: ``--signal=B:USR1@120`` warns the batch shell, whose trap
  relays the signal to every worker (``ddpkit.fault.PreemptionGuard`` saves at the next
  step) and requeues the job, which then resumes from the checkpoint.

The torchrun-agent alternative (one task per node running ``ddpkit launch`` with a c10d
rendezvous on the first node) is documented in docs/multinode.md for plain torchrun
scripts.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ddpkit.errors import ConfigError

# SLURM's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_seconds(limit: str) -> int:
    """Seconds in a SLURM ``--time`` value; ConfigError when it is not one."""
    match = _TIME.match(limit.strip())
    if not match:
        raise ConfigError(f"--time {limit!r} is not a SLURM time (MM, HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = match.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H[:M[:S]]
        h, m, s = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(parts) == 1:  # minutes
        return parts[0] * 60
    if len(parts) == 2:  # minutes:seconds
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


@dataclass(frozen=True)
class SlurmJob:
    """Everything the batch script needs; validated on construction."""

    nodes: int
    gpus_per_node: int
    command: tuple[str, ...]  # "train ARGS..." or "SCRIPT.py ARGS..."
    tasks_per_node: int | None = None  # default: gpus_per_node (required on CPU nodes)
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str = "ddpkit"
    cpus_per_task: int | None = None
    output: str = "%x-%j.out"
    signal_lead_s: int = 120
    python: str = field(default=sys.executable)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.tasks < 1:
            raise ConfigError("CPU-only nodes (--gpus-per-node 0) need --tasks-per-node N")
        if self.gpus_per_node and self.tasks != self.gpus_per_node:
            raise ConfigError(
                f"--tasks-per-node {self.tasks} != --gpus-per-node {self.gpus_per_node}: "
                "ddpkit runs one process per GPU; leave --tasks-per-node out on GPU nodes")
        if not self.command:
            raise ConfigError("nothing to run: give `-- train ARGS` or `-- SCRIPT.py ARGS`")
        head = self.command[0]
        if head != "train" and not head.endswith(".py"):
            raise ConfigError(
                f"`-- {head} ...`: expected `-- train ARGS` (ddpkit train) or `-- SCRIPT.py ARGS`")
        if head.endswith(".py") and not Path(head).is_file():
            raise ConfigError(f"script {head!r} does not exist (paths are relative to where "
                              "you run sbatch)")
        if self.signal_lead_s < 1:
            raise ConfigError(f"--signal-lead must be >= 1 s, got {self.signal_lead_s}")
        if self.time is not None and time_limit_seconds(self.time) <= self.signal_lead_s:
            raise ConfigError(
                f"--time {self.time} leaves no room before the preemption warning "
                f"{self.signal_lead_s} s ahead of the limit; give more time")

    @property
    def tasks(self) -> int:
        return self.tasks_per_node if self.tasks_per_node is not None else self.gpus_per_node

    def worker_argv(self) -> list[str]:
        """What every task runs: ``ddpkit train`` acts as one worker under srun."""
        head, *rest = self.command
        if head == "train":
            return [self.python, "-m", "ddpkit.cli", "train", *rest]
        return [self.python, head, *rest]

    def run_dir(self) -> str | None:
        """For ``train`` without ``--run-dir``/``--resume``: one run directory per job id,
        so a requeued job (``SLURM_RESTART_COUNT`` > 0) finds its own checkpoints."""
        head, *rest = self.command
        if head != "train" or {"--run-dir", "--resume"} & {a.split("=")[0] for a in rest}:
            return None
        out_dir = "runs"
        for i, arg in enumerate(rest):
            if arg == "--out-dir" and i + 1 < len(rest):
                out_dir = rest[i + 1]
            elif arg.startswith("--out-dir="):
                out_dir = arg.split("=", 1)[1]
        return f"{out_dir.rstrip('/')}/slurm-job"


def render(job: SlurmJob, argv: Sequence[str] | None = None) -> str:
    """The sbatch script for ``job`` (``argv``: the command line that made it, for the record)."""
    directives = [
        ("job-name", job.job_name),
        ("nodes", job.nodes),
        ("ntasks-per-node", job.tasks),
    ]
    if job.gpus_per_node:
        # Every task sees all of its node's GPUs and picks cuda:<SLURM_LOCALID> itself;
        # --gpus-per-task would renumber each task's only GPU as cuda:0.
        directives.append(("gpus-per-node", job.gpus_per_node))
    for name, value in (("cpus-per-task", job.cpus_per_task), ("time", job.time),
                        ("partition", job.partition), ("account", job.account)):
        if value is not None:
            directives.append((name, value))
    directives += [
        ("output", job.output),
        ("open-mode", "append"),  # a requeued run appends to the same log
        ("requeue", None),
        ("signal", f"B:USR1@{job.signal_lead_s}"),
    ]
    lines = ["#!/bin/bash"]
    made_by = shlex.join(["ddpkit", "slurm", *argv]) if argv is not None else "ddpkit slurm"
    lines.append(f"# Written by `{made_by}` on {datetime.now():%Y-%m-%d %H:%M}.")
    lines.append("# One task per GPU; every worker reads its rank from SLURM's variables.")
    for name, value in directives:
        lines.append(f"#SBATCH --{name}" + ("" if value is None else f"={value}"))
    worker = shlex.join(job.worker_argv())
    run_dir = job.run_dir()
    if run_dir is not None:
        worker += ' --run-dir "$RUN_DIR"'
    lines += [
        "",
        "set -uo pipefail",
        "",
        "# Rank 0 (task 0) runs on the first node of the allocation and hosts the store.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# A port derived from the job id: two jobs sharing a first node do not collide.",
        "MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}",
        "export MASTER_ADDR MASTER_PORT",
        "",
    ]
    if run_dir is not None:
        lines += [
            "# One run directory per job: a requeued job continues from its checkpoints.",
            f'RUN_DIR={shlex.quote(run_dir)}-"$SLURM_JOB_ID"',
            "",
        ]
    if job.cpus_per_task is not None:
        lines += [
            "# srun (SLURM >= 22.05) no longer inherits --cpus-per-task from sbatch.",
            "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK",
            "",
        ]
    lines += [
        "# SLURM sends USR1 to this shell ahead of the time limit (or on preemption):",
        "# relay it to the workers (srun forwards signals to its tasks) and requeue the job.",
        "requeue() {",
        '    echo "ddpkit: USR1 at $(date +%T): checkpoint and requeue job $SLURM_JOB_ID" >&2',
        '    kill -USR1 "$srun_pid" 2>/dev/null',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "}",
        "trap requeue USR1",
        "",
        "srun --kill-on-bad-exit=1 \\",
        f"    {worker} &",
        "srun_pid=$!",
        "# A trapped signal interrupts `wait`; keep waiting until srun itself has exited.",
        'while wait "$srun_pid"; status=$?; kill -0 "$srun_pid" 2>/dev/null; do :; done',
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def write(job: SlurmJob, path: str | Path, *, force: bool = False,
          argv: Sequence[str] | None = None) -> Path:
    """Write the script to ``path`` (executable); never replace a file unless ``force``."""
    path = Path(path)
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists; choose another --script path or pass --force")
    if not path.parent.is_dir():
        raise ConfigError(f"directory {path.parent} does not exist; create it first")
    path.write_text(render(job, argv))
    path.chmod(0o755)
    return path
