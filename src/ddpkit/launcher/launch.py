"""``ddpkit launch``: torchrun's elastic agent with safer defaults and a readable failure.

We do not write an agent. ``ddpkit launch`` takes any torchrun command line, reads it
with torchrun's own parser (``ddpkit.launcher.torchrun_args``) and hands it to
``torch.distributed.run.run`` (the real agent), so a script and a command line that run
under plain torchrun run unchanged here. What we add, each only where the user left the
choice open:

* one process per accelerator (2 on CPU); a single-node run on a free port (torchrun
  does that too when neither --master-port nor --rdzv-endpoint is given);
* per-rank output prefixed ``[<role><local rank>]:`` (torchrun's ``--tee 3``);
* multi-node c10d: an endpoint that is one of this host's own addresses marks this node as
  the store host (``is_host=1``; torchrun decides that by hostname, which fails inside
  containers and network namespaces and leaves every node waiting as a client), the
  address of the route toward the endpoint is published (``--local-addr``), and gloo
  uses that route's interface (``GLOO_SOCKET_IFNAME``);
* the first failing rank reported once, in one line, with exit code != 0;
* workers that die with the launcher, and no restart after a failure a restart would
  only repeat (a user error, a full disk, a diverged loss: ``ddpkit.runtime.launcher_link``).

``ddpkit train``/``verify`` come in through :func:`launch` with :class:`LaunchOptions`,
which become the same command line for the same agent. (Starting the workers without
the agent on one node would shorten the main job's start-up by the launcher's own
import of torch and the agent's monitor loop, as benchmarks/RESULTS-history.md's
start-up section shows; we keep the real agent: nothing home-made where PyTorch has
the part.)

The launcher owns the terminal (``ddpkit.launcher.console``): rank 0 writes its
progress to a file the launcher names in ``DDPKIT_PROGRESS_FILE``, and the launcher
draws it as a live status line on a terminal, or as a plain line now and then. With
``LaunchOptions.plain_terminal`` (``ddpkit train``, ``ddpkit verify``) a terminal gets
lines for a person: rank 0's without the tee's prefix, the workers' log records without
clock and level, none wider than the terminal or 100 columns (``ddpkit.log``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddpkit.elastic import rendezvous
from ddpkit.errors import ONE_LINE_ERRORS_ENV, ConfigError
from ddpkit.launcher.console import PROGRESS_ENV, Console, columns
from ddpkit.launcher.engine_choice import ENGINE_ENV
from ddpkit.launcher.failure_report import report_failure
from ddpkit.launcher.torchrun_args import check_nproc, default_nproc, nnodes_range
from ddpkit.launcher.worker_heap import worker_malloc_env
from ddpkit.log import TERMINAL_COLUMNS_ENV, get_logger
from ddpkit.runtime.launcher_link import FinalFailure, continue_stopped_children, linked_workers

__all__ = ["LaunchOptions", "check_nproc", "default_nproc", "launch", "launch_argv",
           "route_to", "torchrun_argv"]

log = get_logger(__name__)


@dataclass
class LaunchOptions:
    nproc_per_node: int | None = None  # None: one per accelerator, or 2 on CPU
    nnodes: str = "1"  # "N" or elastic "MIN:MAX"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "ddpkit"
    rdzv_backend: str = "c10d"  # or "etcd-v2": --rdzv-endpoint is then the etcd server
    rdzv_conf: str = ""  # torchrun's --rdzv-conf KEY=VALUE,...
    max_restarts: int = 0
    monitor_interval: float = 0.1  # torchrun's own default
    module: bool = False
    no_python: bool = False
    local_addr: str | None = None
    log_dir: str | None = None
    rdzv_timeout: float | None = None  # seconds to reach the first node and for all to join
    extra_env: dict[str, str] = field(default_factory=dict)
    plain_terminal: bool = False  # lines for a person on a terminal (see the module doc)
    # what torch's DDP name is in the workers; ddpkit train/verify build their engine
    # themselves, and their --engine torch means torch's own class
    engine: str = "torch"


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
            "--monitor-interval", str(opts.monitor_interval), "--tee", "3",
            "--engine", opts.engine]
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
        argv += ["--rdzv-backend", opts.rdzv_backend, "--rdzv-endpoint", opts.rdzv_endpoint,
                 "--rdzv-id", opts.rdzv_id]
        if opts.node_rank is not None:
            argv += ["--node-rank", str(opts.node_rank)]
        is_host = opts.rdzv_backend == "c10d" and (
            host in local_addresses() if opts.node_rank is None else opts.node_rank == 0)
        conf = ["is_host=1"] if is_host else []
        if opts.rdzv_timeout is not None:
            seconds = max(1, round(opts.rdzv_timeout))
            conf += [f"read_timeout={seconds}", f"join_timeout={seconds}"]
        conf += [opts.rdzv_conf] if opts.rdzv_conf else []
        if conf:
            argv += ["--rdzv-conf", ",".join(conf)]
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
    opts = opts or LaunchOptions()
    nproc = default_nproc() if opts.nproc_per_node is None else opts.nproc_per_node
    check_nproc(nproc)
    os.environ.update(opts.extra_env)
    plain = opts.plain_terminal and sys.stderr.isatty()
    if plain:  # the workers' log lines: message only, fitted (ddpkit.log)
        os.environ[TERMINAL_COLUMNS_ENV] = str(columns(sys.stderr))
    return launch_argv([*torchrun_argv(opts, nproc), script, *script_args],
                       timeout_flag="--rdzv-timeout SECONDS", plain_rank0=plain)


@contextlib.contextmanager
def progress_console(plain_prefix: str | None = None):
    """A :class:`Console` following a fresh progress file that the workers learn from
    ``DDPKIT_PROGRESS_FILE``; removed afterwards."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="ddpkit-progress-", suffix=".jsonl")
    os.close(fd)
    previous = os.environ.get(PROGRESS_ENV)
    os.environ[PROGRESS_ENV] = path
    console = Console(path, plain_prefix=plain_prefix).start()
    try:
        yield console
    finally:
        console.close()
        if previous is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = previous
        with contextlib.suppress(OSError):
            os.unlink(path)


def launch_argv(argv: Sequence[str],
                timeout_flag: str = "--rdzv-conf read_timeout=SECONDS",
                plain_rank0: bool = False) -> int:
    """``ddpkit launch ARGV``: any torchrun command line, run by torchrun's agent.

    The line is read by torchrun's own parser (``ddpkit.launcher.torchrun_args``); what ddpkit adds
    on top happens here: the network choices a multi-node c10d job needs, stores that
    listen only where they must (``ddpkit.elastic.rendezvous``), and a one-line summary of the
    first failure. ``timeout_flag`` names the option that bounds the wait for the first
    node, for the message when it does not answer. ``plain_rank0``: on a terminal, local
    rank 0's lines without the tee's prefix. Returns the exit code.
    """
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from ddpkit.elastic import membership
    from ddpkit.launcher import torchrun_args

    args = torchrun_args.parse(list(argv))
    run_through_script_runner(args, torchrun.get_use_env(args))
    os.environ[ENGINE_ENV] = args.engine  # read by every worker (ddpkit.launcher.engine_choice)
    # A DdpkitError escaping the script: one line per rank and exit 2, not a traceback.
    os.environ.setdefault(ONE_LINE_ERRORS_ENV, "1")
    os.environ.update(worker_malloc_env())  # workers reuse large blocks (worker_heap)
    prepare_network(args, timeout_flag)
    final = FinalFailure()
    try:
        # The agent's tee threads write to sys.stdout/sys.stderr: through the console,
        # so rank 0's progress line stays below the workers' output.
        rank0 = f"[{args.role}0]:" if plain_rank0 else None
        with progress_console(rank0) as console, \
                contextlib.redirect_stdout(console.proxy(sys.stdout)), \
                contextlib.redirect_stderr(console.proxy(sys.stderr)), \
                linked_workers(_stop_the_agent) as final, continue_stopped_children(), \
                membership.elastic_agent():
            torchrun.run(args)  # the real agent; it also turns --standalone into a free port
    except membership.HostLostError as err:
        print(f"ddpkit launch: {err}", file=sys.stderr, flush=True)
        return membership.EXIT_HOST_LOST
    except (RendezvousConnectionError, DistNetworkError, DistStoreError) as err:
        cause = err.__cause__ or err.__context__ or err
        where = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
        raise ConfigError(
            f"cannot open the rendezvous store at {where} "
            f"({_first_line(cause)}); on the "
            "first node pick a free port, on the others check that the first node is up "
            "and reachable at that address"
        ) from err
    except RendezvousTimeoutError:
        low, high = nnodes_range(args.nnodes)
        nodes = f"{low}" if low == high else f"{low} to {high}"
        raise ConfigError(
            f"the rendezvous at {args.rdzv_endpoint} did not gather {nodes} nodes in time; "
            f"start every node with the same --rdzv-endpoint and --rdzv-id "
            f"({timeout_flag.replace('read_timeout', 'join_timeout')} sets the wait)"
        ) from None
    except SignalException as err:  # one of --signals-to-handle: the agent passed it on
        if final.code is not None:  # a worker's final failure: it said why, in one line
            return final.code
        name = signal.Signals(err.sigval).name
        print(f"ddpkit launch: got {name}; the workers were sent {name} and have stopped",
              file=sys.stderr)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        return report_failure(err.failures, args.role, plain_rank0)
    finally:
        logging.disable(logging.NOTSET)
    return 0


def run_through_script_runner(args, use_env: bool) -> None:
    """Each rank runs the program through :mod:`ddpkit.launcher.script_runner`: unchanged, but with
    its process groups torn down before the interpreter finalizes (a gloo thread freeing a
    collective's Python objects during finalization aborts a program that succeeded).
    Not for ``--no-python`` executables, ``--run-path`` (in the agent's interpreter) or
    the deprecated ``--no-use-env`` (torchrun puts ``--local-rank`` first)."""
    if args.no_python or args.run_path or not use_env:
        return
    program = ["-m", args.training_script] if args.module else [args.training_script]
    args.training_script_args = [*program, *args.training_script_args]
    args.training_script = "ddpkit.launcher.script_runner"
    args.module = True


def prepare_network(args, timeout_flag: str) -> None:
    """Every choice about the network, before the agent starts: the c10d store host and
    the address and interface of each node (:func:`choose_network`), stores that listen
    on loopback on one node and on the given address across nodes (a fresh workers'
    store for every restart), gloo on loopback on one node, then a first node that does
    not answer as one line."""
    max_nodes = nnodes_range(args.nnodes)[1]
    if not args.standalone:
        choose_network(args, multi_node=max_nodes > 1)
    rendezvous.use_bound_rendezvous(args, max_nodes)
    if max_nodes == 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo listens on the address of this host's name, which may be an external one.
        loopback = route_to("127.0.0.1")[1]
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
    rendezvous.wait_for_first_node(args, timeout_flag)
    if args.max_restarts > 0 and args.rdzv_backend not in (*rendezvous.ELASTIC,
                                                            rendezvous.STATIC):
        # torchrun's agent keeps one store server for every attempt, and a restarted rank
        # can read its dead predecessor's gloo/NCCL address from it ("Connection refused"
        # in connectFullMesh; pytorch/pytorch#135712). Without sharing, rank 0 of each
        # attempt hosts a fresh store. (ddpkit's own handlers make one per attempt.)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _first_line(err: BaseException) -> str:
    """An error's own words: its first line, without the C++ source location."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    return re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text.splitlines()[0])


def _stop_the_agent() -> BaseException:
    """What a worker's final failure raises in the agent's loop: the exception torchrun's
    own signal handlers raise, so the agent stops its workers (SIGTERM, then SIGKILL
    after its grace period) instead of restarting them. Its log lines about stopping
    them would only repeat what the worker said."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    logging.disable(logging.WARNING)
    return SignalException("a worker failed in a way a restart would repeat",
                           sigval=signal.SIGTERM)


def choose_network(args, multi_node: bool) -> None:
    """Which node hosts the c10d store and, on several nodes, the address this node
    publishes and gloo's interface; each only where the user left it open.

    ``is_host`` is explicit even on one node: left to torchrun's guess, a store host that
    cannot bind its port silently becomes a client of whatever holds that port, and waits.
    """
    from torch.distributed.elastic.rendezvous.utils import (
        _parse_rendezvous_config,
        parse_rendezvous_endpoint,
    )

    if args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        conf = _parse_rendezvous_config(args.rdzv_conf)
        if "is_host" not in conf:
            given_rank = "node_rank" in args.ddpkit_given
            if (args.node_rank == 0) if given_rank else host in local_addresses():
                conf["is_host"] = "1"
                args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, "is_host=1"]))
        is_host = str(conf.get("is_host", "")).lower() in ("1", "true", "yes", "y")
        if not multi_node:
            return
        if args.local_addr is None:
            args.local_addr = host if is_host else route_to(host)[0]
    elif args.rdzv_backend == "static" and multi_node:
        host = parse_rendezvous_endpoint(args.rdzv_endpoint or args.master_addr, 0)[0]
    elif args.rdzv_backend == "etcd-v2" and multi_node and args.rdzv_endpoint:
        # etcd is on no node of the job; the route toward it names this node's address.
        host = parse_rendezvous_endpoint(args.rdzv_endpoint, 2379)[0]
        args.local_addr = args.local_addr or route_to(host)[0]
    else:  # one node, or another backend (torch's older etcd) left as it is
        return
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds to the address of this host's name, often 127.0.0.1: peers on other
        # nodes then get "connection refused". Use the interface that reaches the endpoint.
        ifname = route_to(host.strip("[]"))[1]
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
            log.info(f"GLOO_SOCKET_IFNAME={ifname} (the interface toward the rendezvous)")
