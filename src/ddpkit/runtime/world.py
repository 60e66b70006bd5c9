"""Who am I in the job: ranks, sizes and devices, read once from the environment.

A launcher tells each process its place through environment variables, and every
launcher spells them differently. ``World.from_env()`` reads them once, in a fixed
order of precedence, checks them against each other and returns a frozen value that
the rest of the program passes around instead of re-reading ``os.environ``.

Global rank decides who writes shared files; local rank decides which device a process
drives. The two are kept apart on purpose.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ddpkit.errors import ConfigError

SOURCES = ("torchrun", "slurm", "openmpi", "pmi", "single")


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; fix or unset it") from None


def _first_host(nodelist: str) -> str:
    """First host of a SLURM hostlist: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is not a hostlist; set MASTER_ADDR")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


@dataclass(frozen=True)
class World:
    """A process's place in a data-parallel job. Construct with :meth:`from_env`."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    source: str = "single"
    master_addr: str | None = None
    master_port: int | None = None
    # Devices this process drives, e.g. ("cuda:2", "cuda:3") or ("cpu",).
    devices: tuple[str, ...] = field(default=("cpu",))

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{msg} (read from {self.source} environment)")

        if self.world_size < 1:
            raise bad(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise bad(f"rank {self.rank} is outside [0, world size {self.world_size})")
        if self.local_world_size < 1:
            raise bad(f"local world size must be >= 1, got {self.local_world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise bad(
                f"local rank {self.local_rank} is outside "
                f"[0, local world size {self.local_world_size})"
            )
        if self.world_size % self.local_world_size:
            raise bad(
                f"local world size {self.local_world_size} does not divide "
                f"world size {self.world_size}"
            )
        if self.nnodes * self.local_world_size != self.world_size:
            raise bad(
                f"nnodes {self.nnodes} x local world size {self.local_world_size} "
                f"= {self.nnodes * self.local_world_size} != world size {self.world_size}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise bad(f"node rank {self.node_rank} is outside [0, nnodes {self.nnodes})")
        if self.source not in SOURCES:
            raise bad(f"unknown source {self.source!r}")

    # ----------------------------------------------------------------- queries
    @property
    def is_main(self) -> bool:
        """The one process that writes shared files and prints summaries."""
        return self.rank == 0

    @property
    def device(self) -> str:
        """The first (primary) device of this process."""
        return self.devices[0]

    def __str__(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/"
            f"{self.local_world_size}, node {self.node_rank}/{self.nnodes}, "
            f"{','.join(self.devices)}, via {self.source})"
        )

    # ------------------------------------------------------------ construction
    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        devices_per_process: int = 1,
        accelerator: str | None = None,
        device_count: int | None = None,
        require_master_addr: bool = True,
    ) -> World:
        """Read the launcher's variables: torchrun, then SLURM, then OpenMPI, then PMI.

        ``accelerator``/``device_count`` default to what torch sees; tests pass them
        to describe a GPU machine without having one. ``require_master_addr`` is off
        when the caller rendezvous by other means (a ``file://`` or ``tcp://`` method).
        """
        env = os.environ if env is None else env
        fields = _read_launcher(env)
        source = fields["source"]
        if fields["world_size"] > 1 and require_master_addr and not fields.get("master_addr"):
            raise ConfigError(
                f"MASTER_ADDR is not set for a {fields['world_size']}-process run "
                f"(launched via {source}); export MASTER_ADDR=<host of rank 0> "
                "and MASTER_PORT=<free port>, or launch with `ddpkit launch`"
            )
        if accelerator is None or device_count is None:
            accelerator, device_count = _detect_accelerator()
        devices = assign_devices(
            local_rank=fields["local_rank"],
            local_world_size=fields["local_world_size"],
            devices_per_process=devices_per_process,
            accelerator=accelerator,
            device_count=device_count,
        )
        return cls(devices=devices, **fields)


@dataclass(frozen=True)
class _Launcher:
    """The variables one launcher gives each process its place by."""

    source: str
    rank: str
    world_size: str
    local_rank: str  # missing: 0
    local_world_size: str  # missing: the world size (one node)
    node_rank: str | None = None  # missing: 0; None: by slot, rank // local world size
    nnodes: str | None = None  # missing or None: world size // local world size


# In order of precedence: the first whose rank and world size are both set is read.
_LAUNCHERS = (
    _Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              node_rank="GROUP_RANK", nnodes="GROUP_WORLD_SIZE"),
    # local world size and node count: see _slurm_sizes
    _Launcher("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
              node_rank="SLURM_NODEID", nnodes="SLURM_NNODES"),
    # mpirun places ranks by slot: node k holds ranks [k*L, (k+1)*L)
    _Launcher("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    _Launcher("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _int_or(env: Mapping[str, str], name: str | None, default: int) -> int:
    return _int(env, name) if name is not None and name in env else default


def _nodes_by_slot(world_size: int, local_world_size: int) -> int:
    return max(world_size // max(local_world_size, 1), 1)


def _read_launcher(env: Mapping[str, str]) -> dict:
    """Every field of :class:`World` but the devices, from the first launcher whose
    variables are set (a single process when none is)."""
    fields = _rendezvous_address(env)
    launcher = next((x for x in _LAUNCHERS if x.rank in env and x.world_size in env), None)
    if launcher is None:
        return dict(source="single", rank=0, local_rank=0, world_size=1, local_world_size=1,
                    node_rank=0, nnodes=1, **fields)
    rank, world_size = _int(env, launcher.rank), _int(env, launcher.world_size)
    if launcher.source == "slurm":
        local_world_size, nnodes = _slurm_sizes(env, world_size)
        if not fields["master_addr"] and env.get("SLURM_JOB_NODELIST"):
            fields["master_addr"] = _first_host(env["SLURM_JOB_NODELIST"])
    else:
        local_world_size = _int_or(env, launcher.local_world_size, world_size)
        nnodes = _int_or(env, launcher.nnodes, _nodes_by_slot(world_size, local_world_size))
    if launcher.node_rank is None:
        node_rank = rank // max(local_world_size, 1)
    else:
        node_rank = _int_or(env, launcher.node_rank, 0)
    return dict(
        source=launcher.source,
        rank=rank,
        local_rank=_int_or(env, launcher.local_rank, 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        nnodes=nnodes,
        **fields,
    )


def _rendezvous_address(env: Mapping[str, str]) -> dict:
    return {
        "master_addr": env.get("MASTER_ADDR") or None,
        "master_port": _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None,
    }


def _slurm_sizes(env: Mapping[str, str], world_size: int) -> tuple[int, int]:
    """(tasks per node, nodes): SLURM gives the count per node only when it is one number
    (``--ntasks-per-node``); otherwise the tasks must divide evenly over the nodes."""
    nnodes = _int_or(env, "SLURM_NNODES", 1)
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit():
        return int(per_node), nnodes
    if world_size % nnodes == 0:
        return world_size // nnodes, nnodes
    raise ConfigError(
        f"SLURM_NTASKS={world_size} tasks are spread unevenly over "
        f"SLURM_NNODES={nnodes} nodes; "
        "use --ntasks-per-node so every node runs the same count"
    )


def _detect_accelerator() -> tuple[str, int]:
    import torch

    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        return "cpu", 0
    return acc.type, torch.accelerator.device_count()


def assign_devices(
    *,
    local_rank: int,
    local_world_size: int,
    devices_per_process: int,
    accelerator: str,
    device_count: int,
) -> tuple[str, ...]:
    """Devices of one process: a contiguous block chosen by *local* rank.

    PyTorch's DDP tutorial's model-parallel demo uses ``dev0 = rank*2, dev1 = rank*2+1``;
    with global rank that breaks on every node but the first, so the block comes from local rank.
    On CPU every process gets "cpu" (any count is allowed: they share the host).
    """
    if devices_per_process < 1:
        raise ConfigError(f"devices per process must be >= 1, got {devices_per_process}")
    if accelerator == "cpu":
        return ("cpu",) * devices_per_process
    needed = local_world_size * devices_per_process
    if needed > device_count:
        raise ConfigError(
            f"{local_world_size} processes x {devices_per_process} {accelerator} device(s) "
            f"each requires at least {needed} {accelerator.upper()} devices, found {device_count}; "
            "lower --nproc-per-node or devices per process"
        )
    first = local_rank * devices_per_process
    return tuple(f"{accelerator}:{first + i}" for i in range(devices_per_process))
