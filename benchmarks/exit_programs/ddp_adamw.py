"""Data-parallel AdamW on a 14M-parameter MLP (6 x Linear(1536, 1536); --width N for another
width) for 12 steps: ddpkit's DataParallel, or torch's DDP with --torch (then nothing of
ddpkit is imported); --no-teardown leaves the process group to the interpreter's exit."""
import sys

import torch
import torch.distributed as dist
from torch import nn

if "--torch" in sys.argv:
    from torch.nn.parallel import DistributedDataParallel as DDP
else:
    from ddpkit import DataParallel as DDP

width = int(sys.argv[sys.argv.index("--width") + 1]) if "--width" in sys.argv else 1536
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(6)]))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(12):
    loss = model(torch.randn(32, width)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if "--no-teardown" not in sys.argv:
    dist.destroy_process_group()
