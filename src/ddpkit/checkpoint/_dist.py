"""Where this process stands in the job, for the checkpoint modules: rank, world size
and the device loaded tensors belong on. Without a process group: rank 0 of 1."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def local_device() -> torch.device:
    """The device this process drives: where checkpoint tensors should land on load."""
    from ddpkit.runtime.process_group import current_world

    world = current_world()
    if world is not None:
        return torch.device(world.device)
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")
