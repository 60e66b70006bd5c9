"""``ddpkit launch``: torchrun's elastic agent with safer defaults and a readable failure.

We do not write an agent: the arguments are turned into torchrun's own and handed to
``torch.distributed.run`` (``torch.distributed.run.run``), so a script that
runs under plain torchrun runs unchanged here. What we add:

* standalone rendezvous on a free port by default (no hard-coded 29500);
* per-rank output prefixed ``[default<local rank>]:`` (torchrun's ``--tee``);
* a multi-node endpoint that is one of this host's own addresses marks this node as the
  store host (``is_host=1``): torchrun decides that by hostname, which fails inside
  containers and network namespaces and leaves every node waiting as a client;
* the first failing rank reported once, in one line, with exit code != 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger

log = get_logger(__name__)


@dataclass
class LaunchOptions:
    nproc_per_node: int | None = None  # None: one per accelerator, or 2 on CPU
    nnodes: str = "1"  # "N" or elastic "MIN:MAX"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "ddpkit"
    max_restarts: int = 0
    monitor_interval: float = 0.5
    module: bool = False
    no_python: bool = False
    local_addr: str | None = None
    log_dir: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


def default_nproc() -> int:
    import torch

    if torch.accelerator.is_available():
        return torch.accelerator.device_count()
    return 2


def check_nproc(nproc: int) -> None:
    import torch

    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"--nproc-per-node must be a positive integer, got {nproc!r}")
    if torch.accelerator.is_available():
        found = torch.accelerator.device_count()
        kind = torch.accelerator.current_accelerator().type.upper()
        if nproc > found:
            raise ConfigError(
                f"--nproc-per-node {nproc} requires at least {nproc} {kind}s, found {found}"
            )


def local_addresses() -> set[str]:
    """Addresses of this host's interfaces (best effort, stdlib only)."""
    addrs = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
    with contextlib.suppress(OSError):
        addrs.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    try:  # Linux: every IPv4 address assigned in this network namespace
        import subprocess

        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=5).stdout
        fields = [line.split() for line in out.splitlines()]
        addrs.update(f[3].split("/")[0] for f in fields if len(f) > 3)
    except (OSError, subprocess.SubprocessError):
        pass
    return addrs


def route_to(host: str) -> tuple[str | None, str | None]:
    """(source address, interface name) this host uses to reach ``host``; None where unknown.

    A UDP ``connect`` sends no packet: the kernel only picks the route, which tells us the
    address peers can reach us by. Every node needs one: the rank-0 node's ``local_addr``
    becomes every worker's MASTER_ADDR, and without ``--local-addr`` torchrun uses
    ``getfqdn()``, which in containers and namespaces is often ``localhost``.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            addr = probe.getsockname()[0]
    except OSError:
        return None, None
    try:  # the interface that owns the address (not the route's: a host's own IP routes via lo)
        import subprocess

        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return addr, None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == addr:
            return addr, parts[1]
    return addr, None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29400)")
    return host, int(port)


def torchrun_argv(opts: LaunchOptions, nproc: int) -> list[str]:
    argv = ["--nnodes", opts.nnodes, "--nproc-per-node", str(nproc),
            "--max-restarts", str(opts.max_restarts),
            "--monitor-interval", str(opts.monitor_interval), "--tee", "3"]
    if opts.log_dir:
        argv += ["--log-dir", opts.log_dir]
    single_node = opts.nnodes in ("1", "1:1")
    if opts.rdzv_endpoint is None:
        if not single_node:
            raise ConfigError(
                f"--nnodes {opts.nnodes} needs --rdzv-endpoint HOST:PORT of the first node"
            )
        argv.append("--standalone")
    else:
        host, _ = split_endpoint(opts.rdzv_endpoint)
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint,
                 "--rdzv-id", opts.rdzv_id]
        if opts.node_rank is not None:
            argv += ["--node-rank", str(opts.node_rank)]
        is_host = host in local_addresses() if opts.node_rank is None else opts.node_rank == 0
        if is_host:
            argv += ["--rdzv-conf", "is_host=1"]
        local_addr = opts.local_addr or (host if is_host else route_to(host)[0])
        if local_addr:
            argv += ["--local-addr", local_addr]
    if opts.module:
        argv.append("--module")
    if opts.no_python:
        argv.append("--no-python")
    return argv


def launch(script: str, script_args: Sequence[str], opts: LaunchOptions | None = None) -> int:
    """Run ``script`` on every local rank under torchrun's agent; return an exit code."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    opts = opts or LaunchOptions()
    nproc = default_nproc() if opts.nproc_per_node is None else opts.nproc_per_node
    check_nproc(nproc)
    if not opts.module and not opts.no_python and not os.path.isfile(script):
        raise ConfigError(f"script {script!r} does not exist; give the path of a Python file")
    args = torchrun.parse_args([*torchrun_argv(opts, nproc), script, *script_args])
    os.environ.update(opts.extra_env)
    if opts.max_restarts > 0:
        # torchrun's agent keeps one store server for every attempt, and a restarted rank
        # can read its dead predecessor's gloo/NCCL address from it ("Connection refused"
        # in connectFullMesh; pytorch/pytorch#135712). Without sharing, rank 0 of each
        # attempt hosts a fresh store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if opts.rdzv_endpoint and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds to the address of this host's name, often 127.0.0.1: peers on other
        # nodes then get "connection refused". Use the interface that reaches the endpoint.
        ifname = route_to(split_endpoint(opts.rdzv_endpoint)[0])[1]
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
            log.info(f"GLOO_SOCKET_IFNAME={ifname} (the interface toward the rendezvous)")
    try:
        torchrun.run(args)  # the real agent; it also turns --standalone into a free port
    except RendezvousConnectionError as err:
        cause = err.__cause__ or err.__context__ or err
        raise ConfigError(
            f"cannot open the rendezvous store at {opts.rdzv_endpoint or 'localhost'} "
            f"({str(cause).splitlines()[0] if str(cause) else type(cause).__name__}); on the "
            "first node pick a free port, on the others check that the first node is up "
            "and reachable at that address"
        ) from err
    except ChildFailedError as err:
        rank, failure = root_cause(err.failures)
        others = sorted(r for r in err.failures if r != rank)
        also = f"; ranks {others} failed after it" if others else ""
        if failure.exitcode < 0:  # killed by a signal: there is no traceback to point at
            what = (f"was killed by {signal.Signals(-failure.exitcode).name} "
                    f"(pid {failure.pid}; out of memory or killed from outside?)")
        else:
            what = (f"failed first (exit code {failure.exitcode}, pid {failure.pid}); its "
                    f"traceback is above, prefixed [default{failure.local_rank}]")
        print(f"ddpkit launch: rank {rank} {what}{also}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


# Messages of ranks that died only because a peer went away first.
_PEER_GONE = ("Connection closed by peer", "Connection reset", "Broken pipe", "DistBackendError",
              "DistNetworkError")


def root_cause(failures: dict) -> tuple[int, object]:
    """The failure that caused the others.

    A rank killed by a signal of its own (SIGKILL from the OOM killer, SIGSEGV) had no
    chance to report and its peers fail within moments of it, often in an earlier
    second of torchrun's clock: it is the cause. Exit -SIGTERM is the agent stopping the
    survivors, never the cause. Otherwise the earliest error wins; torchrun's timestamps
    have one-second resolution, so a rank that raised and the peer whose collective then
    broke usually tie, and among those we prefer the failure that is not a lost connection.
    """
    def key(item):
        rank, failure = item
        message = str(getattr(failure, "message", ""))
        stopped_by_agent = failure.exitcode == -signal.SIGTERM
        killed_by_signal = failure.exitcode < 0 and not stopped_by_agent
        return (stopped_by_agent, not killed_by_signal, failure.timestamp,
                any(p in message for p in _PEER_GONE), rank)

    return min(failures.items(), key=key)
