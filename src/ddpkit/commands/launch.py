"""``ddpkit launch``: run a script on N local ranks (and M nodes) under torchrun's agent.

Its command line is torchrun's (every flag in both spellings, read by torchrun's own
parser in ``ddpkit.launcher.torchrun_args``), so the subcommand passes everything after
``launch`` through untouched.
"""

from __future__ import annotations

import argparse

from ddpkit.launcher.launch import LaunchOptions


def options_from_args(args) -> LaunchOptions:
    return LaunchOptions(
        nproc_per_node=args.nproc_per_node,
        nnodes=str(args.nnodes),
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_backend=getattr(args, "rdzv_backend", "c10d"),
        rdzv_conf=getattr(args, "rdzv_conf", ""),
        max_restarts=getattr(args, "max_restarts", 0),
        local_addr=args.local_addr,
    )


def register(sub) -> None:
    # A prefix character nobody types: argparse then sees every word after `launch` as
    # the one positional below, and torchrun's parser (with one-line errors) reads them.
    p = sub.add_parser(
        "launch", help="run a script on every rank: any torchrun command line (torchrun's agent)",
        prefix_chars="\0", add_help=False,
        usage="ddpkit launch [torchrun options] SCRIPT [ARGS ...]   (ddpkit launch --help)")
    p.add_argument("torchrun_argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def run(args) -> int:
    from ddpkit.launcher.launch import launch_argv

    return launch_argv(args.torchrun_argv)
