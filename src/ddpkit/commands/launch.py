"""``ddpkit launch``: run a script on N local ranks (and M nodes) under torchrun's agent."""

from __future__ import annotations

import argparse

from ddpkit.launch import LaunchOptions, launch


def add_launch_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `launch` and `train` (which launches itself)."""
    g = p.add_argument_group("launch")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes on this node (default: one per GPU, or 2 on CPU)",
    )
    g.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic")
    g.add_argument(
        "--node-rank", type=int, default=None, help="this node's rank (static rendezvous)"
    )
    g.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT of the c10d rendezvous on the first node (multi-node)",
    )
    g.add_argument("--rdzv-id", default="ddpkit", help="job id shared by all nodes")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all workers up to K times when one fails",
    )
    g.add_argument("--local-addr", default=None, help="address other nodes reach this node by")


def options_from_args(args) -> LaunchOptions:
    return LaunchOptions(
        nproc_per_node=args.nproc_per_node,
        nnodes=str(args.nnodes),
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        local_addr=args.local_addr,
    )


def register(sub) -> None:
    p = sub.add_parser("launch", help="run a training script on every rank (torchrun's agent)")
    add_launch_options(p)
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m)")
    p.add_argument("--no-python", action="store_true", help="SCRIPT is an executable, not Python")
    p.add_argument("script", help="the program every rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=run)


def run(args) -> int:
    opts = options_from_args(args)
    opts.module, opts.no_python = args.module, args.no_python
    return launch(args.script, args.script_args, opts)
