"""The routed small all_reduce's own cost in one process: the dispatcher and the direct path.

    flock /work/wt/cpu.lock .venv/bin/python benchmarks/torch_route_parts.py [label]

What ``torch.distributed.all_reduce`` of 256 float32 costs a rank apart from waiting for
its peer: the shared-memory direct path (comm/shm/direct.py) is bound to a stand-in
communicator of two ranks whose barrier returns at once and whose peer's words are
preset as a peer that called alike would publish them, and remembered as the route's
answer for this call (comm/torch_route.py), in a one-rank gloo group. Timed with
``timeit``: 9 alternations of 50,000 calls of the direct path and of the routed call,
medians; the dispatcher is their difference. Run with another ddpkit on ``PYTHONPATH``
to compare (an older torch_route's remembered entries are laid out without the dtype).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import timeit
import weakref

import torch
import torch.distributed as dist

from ddpkit.comm import registry, torch_route
from ddpkit.comm.shm import direct
from ddpkit.comm.shm.sync import LINE_WORDS, Control

WORD = 12345  # the signature word both "ranks" publish


class _View:
    size = 2


class _Communicator:
    """What DirectAllReduce reads of a communicator: rank 0 of two, barrier a no-op."""

    def __init__(self):
        self.buf = bytearray(2 * LINE_WORDS * 8)
        self.control = Control(self.buf, 2, 0, 10.0, ["rank 0", "rank 1"])
        self.control.barrier = lambda: None
        self.view, self.me, self.local_size = _View(), 0, 2
        self._calls, self._closed = 0, False
        self._small = [[torch.zeros(64 << 10, dtype=torch.uint8) for _ in range(2)]
                       for _ in range(2)]


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this ddpkit"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store",
                            rank=0, world_size=1)
    comm = _Communicator()
    path = direct.DirectAllReduce(comm, "sum", torch.float32, WORD)
    tensor = torch.ones(256)
    for parity in (0, 1):
        at = comm.control.meta_index(1, 4, parity)
        comm.control.cells[at], comm.control.cells[at + 1] = tensor.numel(), WORD
    torch_route.route()
    pg, op = dist.distributed_c10d._world.default_pg, dist.ReduceOp.SUM
    key = (id(pg), torch.float32, id(op))
    if hasattr(torch_route, "_last"):
        entry = (weakref.ref(pg), op, torch.float32, path, registry.version())
        torch_route._direct[key] = torch_route._last[0] = entry
    else:
        torch_route._direct[key] = (weakref.ref(pg), op, path, registry.version())
    scope = {"path": path, "tensor": tensor, "dist": dist}
    direct_us, routed_us = [], []
    for _ in range(9):
        direct_us.append(timeit.timeit("path(tensor)", globals=scope, number=50000) * 20)
        routed_us.append(timeit.timeit("dist.all_reduce(tensor)", globals=scope,
                                       number=50000) * 20)
    d, r = statistics.median(direct_us), statistics.median(routed_us)
    print(f"{label}: direct path {d:.2f} us, routed call {r:.2f} us, dispatcher {r - d:.2f} us")
    torch_route.restore()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
