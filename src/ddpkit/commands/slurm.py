"""``ddpkit slurm``: write an sbatch script that runs a ddpkit job on N nodes x G GPUs.

    ddpkit slurm --nodes 4 --gpus-per-node 8 --time 12:00:00 -- train --epochs 90
    sbatch ddpkit.sbatch

--launcher srun (default): one task per GPU, World from SLURM's variables.
--launcher torchrun: one task per node running torchrun's agent (ddpkit launch), c10d
rendezvous on the first node, --max-restarts per node. Both requeue on preemption
(see ddpkit.launcher.slurm_script and docs/multinode.md for when to choose which).
"""

from __future__ import annotations

import argparse
import sys

from ddpkit.commands.old_spellings import keep_old_spellings
from ddpkit.launcher.slurm_script import DEFAULT_RESTARTS, LAUNCHERS, SlurmJob, write

DESCRIPTION = """\
Write an sbatch script that runs a ddpkit job on N nodes x G GPUs, then submit it:

    ddpkit slurm --nodes 4 --gpus-per-node 8 --time 12:00:00 -- train --epochs 90
    sbatch ddpkit.sbatch

--launcher srun (default): one task per GPU; every worker reads its rank from SLURM.
--launcher torchrun: one task per node running torchrun's agent (ddpkit launch), c10d
rendezvous on the first node, --max-restarts per node. Both requeue the job when it is
preempted or near its time limit (docs/multinode.md says when to choose which).
"""


def register(sub) -> None:
    p = sub.add_parser("slurm", help="write an sbatch script for an N-node job (requeues)",
                       description=DESCRIPTION)
    p.add_argument("--nodes", type=int, required=True, help="nodes to allocate (N)")
    p.add_argument("--gpus-per-node", type=int, required=True,
                   help="GPUs per node (G); one task per GPU. 0 for CPU nodes")
    p.add_argument("--ntasks-per-node", type=int, default=None,
                   help="processes per node on CPU nodes (default: --gpus-per-node)")
    p.add_argument("--launcher", default="srun", metavar="|".join(LAUNCHERS),
                   help="srun: one task per GPU (default); torchrun: one task per node "
                        "running torchrun's agent (c10d rendezvous, restarts per node)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="K",
                   help=f"--launcher torchrun: restart a node's workers up to K times "
                        f"(default: {DEFAULT_RESTARTS})")
    p.add_argument("--time", default=None, help="time limit, e.g. 12:00:00 or 1-00:00:00 "
                   "(default: the partition's)")
    p.add_argument("--partition", default=None,
                   help="SLURM partition (default: the cluster's default partition)")
    p.add_argument("--account", default=None,
                   help="SLURM account to charge (default: your default account)")
    p.add_argument("--job-name", default="ddpkit", help="job name (default: ddpkit)")
    p.add_argument("--cpus-per-task", type=int, default=None,
                   help="CPU cores per task (default: SLURM's)")
    p.add_argument("--output", default="%x-%j.out",
                   help="the job's log file, sbatch's --output pattern (default: %%x-%%j.out)")
    p.add_argument("--signal-lead", type=int, default=120, metavar="SECONDS",
                   help="warn (USR1) this long before the time limit, then requeue (default: 120)")
    p.add_argument("--out", default="ddpkit.sbatch",
                   help="the sbatch script to write (default: ddpkit.sbatch)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    keep_old_spellings(p, "slurm")
    # dest must not be "command": the top-level parser keeps the subcommand name there.
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="after --: `train ARGS` (ddpkit train) or `SCRIPT.py ARGS`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = list(args.job)
    if command[:1] == ["--"]:
        command = command[1:]
    job = SlurmJob(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, command=tuple(command),
        tasks_per_node=args.ntasks_per_node, time=args.time, partition=args.partition,
        account=args.account, job_name=args.job_name, cpus_per_task=args.cpus_per_task,
        output=args.output, signal_lead_s=args.signal_lead, launcher=args.launcher,
        max_restarts=args.max_restarts,
    )
    path = write(job, args.out, force=args.force, argv=sys.argv[2:])
    world = job.nodes * job.tasks
    per_node = (f"1 agent x {job.tasks} worker(s)" if job.launcher == "torchrun"
                else f"{job.tasks} task(s)")
    print(f"wrote {path}: {job.nodes} node(s) x {per_node} = {world} ranks; "
          f"submit with: sbatch {path}")
    return 0
