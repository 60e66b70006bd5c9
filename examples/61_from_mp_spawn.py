"""Coming from mp.spawn: ddpkit.spawn(fn, nprocs) and no setup()/cleanup().

The torch tutorial's program (shown whole in docs/migrating.md) starts its ranks with
torch.multiprocessing.spawn and joins them through a hard-coded MASTER_PORT. Here:

* ``train(rank, world_size, ...)`` becomes ``train(world, ...)``: ``world.rank``,
  ``world.world_size``, ``world.device``, ``world.is_main``;
* ``setup()``/``cleanup()`` are gone: each rank joins a process group through a
  FileStore in a private temporary directory (no port: two copies never collide) and
  leaves it whatever happens;
* ``mp.spawn(train, args=..., nprocs=N, join=True)`` becomes
  ``ddpkit.spawn(train, nprocs=N, args=...)``, which returns each rank's value and
  re-raises a failed rank's exception in the parent with its rank and traceback;
* the DDP import is ddpkit's (optional: torch's DDP works under ddpkit.spawn too).

The same file also runs under a launcher, one process per rank, without spawn.

Run:  python examples/61_from_mp_spawn.py [SAVE_PATH]
  or: ddpkit launch --nproc-per-node 2 examples/61_from_mp_spawn.py [SAVE_PATH]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit import DataParallel as DDP


def train(world: ddpkit.World, save: str | None) -> float:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(world.rank)
    for _ in range(5):
        x, y = torch.randn(16, 10, generator=g), torch.randn(16, 5, generator=g)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    if world.is_main and save:
        torch.save(model.module.state_dict(), save)
    return loss.item()


def main() -> None:
    save = sys.argv[1] if len(sys.argv) > 1 else None
    if ddpkit.World.from_env().source == "single":  # started with plain `python`
        losses = ddpkit.spawn(train, nprocs=2, args=(save,))
        print(f"last loss per rank: {losses}")
    else:  # started by ddpkit launch / torchrun / srun: this process is one rank
        with ddpkit.distributed() as world:
            loss = train(world, save)
            print(f"rank {world.rank}: last loss {loss:.6f}")


if __name__ == "__main__":
    main()
