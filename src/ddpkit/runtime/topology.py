"""Plan how processes map onto nodes and devices (the process-mapping table of
PyTorch's torchrun DDP example).

N nodes x G devices per node, each process spanning D devices, gives L = G / D
processes per node and W = N * L processes in all. The table lists, per process, its
node, local rank, global rank and the devices it drives.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.errors import ConfigError
from ddpkit.runtime.world import assign_devices


@dataclass(frozen=True)
class Placement:
    node: int
    local_rank: int
    rank: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    nnodes: int
    devices_per_node: int
    devices_per_process: int = 1

    def __post_init__(self) -> None:
        for name in ("nnodes", "devices_per_node", "devices_per_process"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {value}"
                )
        if self.devices_per_node % self.devices_per_process:
            raise ConfigError(
                f"--devices-per-node {self.devices_per_node} is not divisible by "
                f"--devices-per-process {self.devices_per_process}"
                "; each process needs a whole block"
            )

    @property
    def local_world_size(self) -> int:
        return self.devices_per_node // self.devices_per_process

    @property
    def world_size(self) -> int:
        return self.nnodes * self.local_world_size

    def placements(self) -> list[Placement]:
        table = []
        for node in range(self.nnodes):
            for local_rank in range(self.local_world_size):
                names = assign_devices(
                    local_rank=local_rank,
                    local_world_size=self.local_world_size,
                    devices_per_process=self.devices_per_process,
                    accelerator="gpu",
                    device_count=self.devices_per_node,
                )
                devices = tuple(int(n.split(":")[1]) for n in names)
                table.append(
                    Placement(node, local_rank, node * self.local_world_size + local_rank, devices)
                )
        return table

    def render(self) -> str:
        rows = [("node", "local rank", "global rank", "devices")]
        rows += [
            (str(p.node), str(p.local_rank), str(p.rank), ", ".join(f"gpu{d}" for d in p.devices))
            for p in self.placements()
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"N={self.nnodes} nodes x G={self.devices_per_node} devices/node, "
            f"{self.devices_per_process} device(s)/process -> L={self.local_world_size} "
            f"processes/node, W={self.world_size} processes"
        ]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)
