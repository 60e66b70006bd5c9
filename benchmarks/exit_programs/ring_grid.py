"""A grid of all-reduces over sizes, dtypes and ops with ddpkit's ring (or torch's own with
--torch, which imports nothing of ddpkit), then teardown."""
import sys

import torch
import torch.distributed as dist

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

if "--torch" in sys.argv:
    def all_reduce(t, op):
        dist.all_reduce(t, OPS[op])
else:
    import ddpkit

    def all_reduce(t, op):
        ddpkit.comm.all_reduce(t, op=op, algo="ring")

dist.init_process_group("gloo")
for numel in (1, 100, 10_000, 300_000):
    for dtype in (torch.float32, torch.float64, torch.int32):
        for op in OPS:
            all_reduce(torch.full((numel,), dist.get_rank() + 1, dtype=dtype), op)
dist.destroy_process_group()
