"""``ddpkit launch``: run a script on N local ranks (and M nodes) under torchrun's agent.

Its command line is torchrun's (every flag in both spellings, read by torchrun's own
parser in ``ddpkit.launcher.torchrun_args``), so the subcommand passes everything after
``launch`` through untouched.
"""

from __future__ import annotations

import argparse

from ddpkit.launcher.launch import LaunchOptions


def add_launch_options(p: argparse.ArgumentParser, restarts: bool = True) -> None:
    """Options shared by `train` and `verify` (which launch themselves); ``restarts``:
    whether --max-restarts applies (a verification is not resumed)."""
    g = p.add_argument_group("launch")
    g.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=None,
        help="processes on this node (default: one per GPU, or 2 on CPU)",
    )
    g.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic")
    g.add_argument(
        "--node-rank", "--node_rank", type=int, default=None,
        help="this node's rank (static rendezvous) (default: given by the rendezvous)",
    )
    g.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        help="HOST:PORT of the rendezvous (multi-node): c10d's on the first node, or "
             "the etcd server (default: none, one node)",
    )
    g.add_argument("--rdzv-id", "--rdzv_id", default="ddpkit", help="job id shared by all nodes")
    g.add_argument("--rdzv-backend", "--rdzv_backend", choices=("c10d", "etcd-v2"),
                   default="c10d",
                   help="c10d: the rendezvous store lives on the first node, so the job "
                        "cannot outlive it; etcd-v2: --rdzv-endpoint is an etcd server "
                        "(v2 API, python-etcd client), any node may be lost")
    g.add_argument("--rdzv-conf", "--rdzv_conf", default="", metavar="KEY=VALUE,...",
                   help="torchrun's rendezvous settings, e.g. keep_alive_interval=2,"
                        "keep_alive_max_attempt=5 (default: none; several nodes: "
                        "docs/multinode.md gives ddpkit's detection defaults)")
    if restarts:
        g.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="K",
                       help="restart all workers up to K times when one fails")
    g.add_argument("--local-addr", "--local_addr", default=None,
                   help="address other nodes reach this node by (default: the source "
                        "address of the route to --rdzv-endpoint)")


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
