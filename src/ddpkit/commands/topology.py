"""``ddpkit topology``: print how processes map onto nodes and devices."""

from __future__ import annotations

from ddpkit.runtime.topology import Topology


def register(sub) -> None:
    p = sub.add_parser("topology", help="print the node x device x process mapping table")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (N)")
    p.add_argument("--devices-per-node", type=int, required=True, help="devices per node (G)")
    p.add_argument("--devices-per-process", type=int, default=1, help="devices each process spans")
    p.set_defaults(func=run)


def run(args) -> int:
    topo = Topology(args.nnodes, args.devices_per_node, args.devices_per_process)
    print(topo.render())
    return 0
