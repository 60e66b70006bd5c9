"""SLURM batch scripts for ddpkit jobs, in one of two layouts (``--launcher``).

``srun`` (default): one task per GPU, World from SLURM's variables.

* ``ddpkit train`` and every program that calls ``ddpkit.init()`` already read
  ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``/``SLURM_NNODES`` (``World.from_env``),
  so no second process manager sits between SLURM and the workers: SLURM starts, signals
  and kills each of them (``--kill-on-bad-exit``), and its accounting sees every rank.
* Rank 0 is SLURM task 0, which SLURM places on the first node of the allocation, the
  same host ``scontrol show hostnames`` lists first: MASTER_ADDR points at rank 0's own
  store, with no rendezvous round and no node-ordering surprise.

``torchrun`` (PyTorch's multi-node tutorial's layout): one task per node running torchrun's agent
(``ddpkit launch``), c10d rendezvous on the first node, so a worker that dies is
restarted by its node's agent (``--max-restarts``) without giving the allocation back,
and a plain torchrun script (one that reads ``RANK``/``LOCAL_RANK``, not SLURM's
variables) runs unchanged. The task on node 0 hosts the store (``is_host`` from
``SLURM_NODEID``, not from hostname matching, which fails in containers).

In both, preemption is SLURM's job: ``--signal=B:USR1@120`` warns the batch shell, whose
trap relays the signal to the tasks (``ddpkit.fault.PreemptionGuard`` saves at the next
step; under the agent, torchrun forwards it to the workers) and requeues the job, which
then resumes from the checkpoint. docs/multinode.md says when to choose which.
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

LAUNCHERS = ("srun", "torchrun")
DEFAULT_RESTARTS = 3  # torchrun layout: restarts of a node's workers before the job fails
# torchrun's agent forwards only these to its workers; SLURM's warning is USR1.
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"

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
    launcher: str = "srun"  # one of LAUNCHERS
    max_restarts: int | None = None  # torchrun layout only; default DEFAULT_RESTARTS
    python: str = field(default=sys.executable)

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"--launcher {self.launcher!r} is not one of "
                              f"{', '.join(LAUNCHERS)}")
        if self.max_restarts is not None and self.launcher == "srun":
            raise ConfigError("--max-restarts needs --launcher torchrun: under srun no agent "
                              "restarts workers (a requeue still resumes from checkpoints)")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.tasks < 1:
            raise ConfigError("CPU-only nodes (--gpus-per-node 0) need --ntasks-per-node N")
        if self.gpus_per_node and self.tasks != self.gpus_per_node:
            raise ConfigError(
                f"--ntasks-per-node {self.tasks} != --gpus-per-node {self.gpus_per_node}: "
                "ddpkit runs one process per GPU; leave --ntasks-per-node out on GPU nodes")
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
        """Ranks per node (SLURM tasks under srun; the agent's workers under torchrun)."""
        return self.tasks_per_node if self.tasks_per_node is not None else self.gpus_per_node

    @property
    def restarts(self) -> int:
        return DEFAULT_RESTARTS if self.max_restarts is None else self.max_restarts

    def agent_program(self) -> list[str]:
        """Torchrun layout: what ``ddpkit launch`` runs on every rank. Not ``ddpkit
        train``, which under srun would see SLURM's variables and be a single worker."""
        head, *rest = self.command
        return ["-m", "ddpkit.train.worker", *rest] if head == "train" else [head, *rest]

    def agent_argv(self) -> list[str]:
        """Torchrun layout: the task on every node, up to :meth:`agent_program`. Words
        starting with ``$`` are the batch shell's variables (rendezvous address, job id)."""
        return [self.python, "-m", "ddpkit.cli", "launch", "--nnodes", str(self.nodes),
                "--nproc-per-node", str(self.tasks), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "$RDZV_HOST:$RDZV_PORT", "--rdzv-id", "$SLURM_JOB_ID",
                "--max-restarts", str(self.restarts), "--signals-to-handle", AGENT_SIGNALS,
                # Preempted workers checkpoint before they exit: give them the warning's
                # lead before the agent kills them (torchrun's default is 30 s).
                "--shutdown-timeout", str(self.signal_lead_s)]

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
    torchrun = job.launcher == "torchrun"
    lines = ["#!/bin/bash"]
    made_by = shlex.join(["ddpkit", "slurm", *argv]) if argv is not None else "ddpkit slurm"
    lines.append(f"# Written by `{made_by}` on {datetime.now():%Y-%m-%d %H:%M}.")
    if torchrun:
        lines.append("# One task per node running torchrun's agent (ddpkit launch): c10d")
        lines.append("# rendezvous on the first node, elastic restarts per node.")
    else:
        lines.append("# One task per GPU; every worker reads its rank from SLURM's variables.")
    for name, value in _directives(job):
        lines.append(f"#SBATCH --{name}" + ("" if value is None else f"={value}"))
    lines += ["", "set -uo pipefail", ""]
    lines += _rendezvous(job)
    run_dir = job.run_dir()
    if run_dir is not None:
        lines += [
            "# One run directory per job: a requeued job continues from its checkpoints.",
            f'RUN_DIR={shlex.quote(run_dir)}-"$SLURM_JOB_ID"',
        ]
        if torchrun:  # under the agent every attempt reads as restart 0: say "resume"
            lines += [
                "# The agent numbers the attempts of this job only; a requeued job resumes.",
                "# (a checkpoint is a directory with its manifest inside; format 1: step_N.json)",
                'if compgen -G "$RUN_DIR/checkpoints/step_*/manifest.json" > /dev/null ||',
                '        compgen -G "$RUN_DIR/checkpoints/step_*.json" > /dev/null; then',
                '    RUN_ARGS=(--resume "$RUN_DIR")',
                "else",
                '    RUN_ARGS=(--run-dir "$RUN_DIR")',
                "fi",
            ]
        lines.append("")
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
    ]
    lines += _torchrun_step(job) if torchrun else _srun_step(job)
    lines += [
        "srun_pid=$!",
        "# A trapped signal interrupts `wait`; keep waiting until srun itself has exited.",
        'while wait "$srun_pid"; status=$?; kill -0 "$srun_pid" 2>/dev/null; do :; done',
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def _directives(job: SlurmJob) -> list[tuple[str, object]]:
    directives = [
        ("job-name", job.job_name),
        ("nodes", job.nodes),
        ("ntasks-per-node", 1 if job.launcher == "torchrun" else job.tasks),
    ]
    if job.gpus_per_node:
        # Every task sees all of its node's GPUs and picks cuda:<SLURM_LOCALID> itself;
        # --gpus-per-task would renumber each task's only GPU as cuda:0.
        directives.append(("gpus-per-node", job.gpus_per_node))
    for name, value in (("cpus-per-task", job.cpus_per_task), ("time", job.time),
                        ("partition", job.partition), ("account", job.account)):
        if value is not None:
            directives.append((name, value))
    return directives + [
        ("output", job.output),
        ("open-mode", "append"),  # a requeued run appends to the same log
        ("requeue", None),
        ("signal", f"B:USR1@{job.signal_lead_s}"),
    ]


def _rendezvous(job: SlurmJob) -> list[str]:
    if job.launcher == "torchrun":
        return [
            "# The first node of the allocation hosts the c10d rendezvous store.",
            'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "# A port derived from the job id: two jobs sharing a first node do not collide.",
            "RDZV_PORT=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}",
            "",
        ]
    return [
        "# Rank 0 (task 0) runs on the first node of the allocation and hosts the store.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# A port derived from the job id: two jobs sharing a first node do not collide.",
        "MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}",
        "export MASTER_ADDR MASTER_PORT",
        "",
    ]


def _srun_step(job: SlurmJob) -> list[str]:
    worker = shlex.join(job.worker_argv())
    if job.run_dir() is not None:
        worker += ' --run-dir "$RUN_DIR"'
    return ["srun --kill-on-bad-exit=1 \\", f"    {worker} &"]


def _torchrun_step(job: SlurmJob) -> list[str]:
    # The batch shell's variables expand here, once, the same for every node; the
    # user's own words are quoted as they are.
    words = [f'"{w}"' if w.startswith("$") else shlex.quote(w) for w in job.agent_argv()]
    words += [shlex.quote(w) for w in job.agent_program()]
    if job.run_dir() is not None:
        words.append('"${RUN_ARGS[@]}"')
    rows = [""]
    for word in words:  # wrapped for reading; a word never splits
        if rows[-1] and len(rows[-1]) + len(word) > 84:
            rows.append("")
        rows[-1] = f"{rows[-1]} {word}".strip()
    return [
        "# One agent per node. The task on node 0 (the host above) hosts the store, set",
        "# per task through torchrun's own PET_RDZV_CONF: matching hostnames, torchrun's",
        "# way, fails in containers.",
        "srun --kill-on-bad-exit=1 \\",
        "    bash -c 'export PET_RDZV_CONF=\"is_host=$((SLURM_NODEID == 0))\"; exec \"$@\"' "
        "ddpkit-node \\",
        *(f"    {row} \\" for row in rows[:-1]),
        f"    {rows[-1]} &",
    ]


def write(job: SlurmJob, path: str | Path, *, force: bool = False,
          argv: Sequence[str] | None = None) -> Path:
    """Write the script to ``path`` (executable); never replace a file unless ``force``."""
    path = Path(path)
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists; choose another --out path or pass --force")
    if not path.parent.is_dir():
        raise ConfigError(f"directory {path.parent} does not exist; create it first")
    path.write_text(render(job, argv))
    path.chmod(0o755)
    return path
