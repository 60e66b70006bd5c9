"""ddpkit's default collectives, then the program's own teardown (run by every rank)."""
import torch
import torch.distributed as dist

import ddpkit

dist.init_process_group("gloo")
t = torch.full((1000,), float(dist.get_rank() + 1))
ddpkit.comm.all_reduce(t)
ddpkit.comm.broadcast(t, 0)
expected = dist.get_world_size() * (dist.get_world_size() + 1) / 2
assert torch.equal(t, torch.full((1000,), expected)), t[:4]
dist.destroy_process_group()
