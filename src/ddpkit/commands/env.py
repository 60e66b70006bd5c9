"""``ddpkit env``: print what a bug report needs (versions, backends, machine, env vars)."""

from __future__ import annotations

import os
import platform
import shutil
import sys

from ddpkit.runtime.torch_target import TORCH_CHECKED

# Variables that decide how a distributed run starts; their values go in a bug report.
_ENV_EXACT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
_ENV_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "NCCL_", "GLOO_",
                 "TORCH_", "DDPKIT_")


def register(sub) -> None:
    p = sub.add_parser("env", help="print versions, backends and environment for a bug report")
    p.set_defaults(func=run)


def distributed_env(environ=os.environ) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items())
            if (k in _ENV_EXACT or k.startswith(_ENV_PREFIXES)) and k != "DDPKIT_CLI_LOGGING"}


def _memory_gib() -> str:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return f"{pages * size / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        return "unknown"


def _shm_free() -> str:
    try:
        return f"{shutil.disk_usage('/dev/shm').free / 2**30:.1f} GiB free"
    except OSError:
        return "not available"


def report() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    from ddpkit.cli import package_version

    rows = [
        ("ddpkit", package_version()),
        ("torch", torch.__version__),
        ("torch checked", TORCH_CHECKED),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
        ("cpu cores", f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})"
         if hasattr(os, "sched_getaffinity") else str(os.cpu_count())),
        ("memory", _memory_gib()),
        ("/dev/shm", _shm_free()),
    ]
    avail = dist.is_available()
    for backend in ("gloo", "nccl", "mpi", "ucc"):
        ok = avail and getattr(dist, f"is_{backend}_available", lambda: False)()
        rows.append((f"backend {backend}", "yes" if ok else "no"))
    cuda = torch.cuda.is_available()
    rows.append(("cuda available", "yes" if cuda else "no"))
    rows.append(("cuda devices", str(torch.cuda.device_count() if cuda else 0)))
    rows.append(("cuda version", str(torch.version.cuda)))
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "n/a"
    except (RuntimeError, AttributeError):
        nccl = "n/a"
    rows.append(("nccl version", nccl))
    return rows


def run(args) -> int:
    rows = report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    env = distributed_env()
    print("distributed environment variables:" + ("" if env else " none set"))
    for key, value in env.items():
        print(f"  {key}={value}")
    return 0
