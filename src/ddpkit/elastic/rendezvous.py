"""torchrun's rendezvous, listening only where it must, and a first node that answers.

**Where the stores listen.** torchrun's c10d rendezvous hosts two TCPStores in the
agent (the rendezvous state, and the store the workers meet in through MASTER_ADDR and
MASTER_PORT), and its static rendezvous one; a TCPStore server listens on every address
of the machine (``*:<port>``) whatever host it was given, and answers anyone without
authentication. Here the same handlers (``DynamicRendezvousHandler`` and
``StaticTCPRendezvous``, torch's own) get stores whose listening socket is bound
before the store takes it over (``TCPStore(master_listen_fd=...)``): a single-node run
listens on 127.0.0.1 only, a multi-node run on the address the user named (every
address only when that name resolves to loopback here, which the other nodes cannot
reach anyway).

The workers' store is also made fresh for every round of the rendezvous: restarted
workers (``--max-restarts``) then never read the addresses their dead predecessors
published (gloo's ``connectFullMesh`` fails on them, pytorch/pytorch#135712), so the
workers can keep using the agent's store instead of rank 0 hosting one of its own on
every address.

**A first node that answers.** A node that joins someone else's store (c10d on a node
that does not host it, static with node rank > 0) first checks that the endpoint
accepts connections, in Python, within the rendezvous timeout: an unreachable address
is one clear line at once, a silent one is one clear line at the timeout, instead of
the C++ client's retries, each printed with its frame dump.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
import uuid
from datetime import timedelta

from ddpkit.errors import ConfigError

C10D = "ddpkit-c10d"  # torch's c10d rendezvous, stores bound as above
ETCD = "ddpkit-etcd-v2"  # torch's etcd-v2 rendezvous, workers' store bound as above
STATIC = "ddpkit-static"  # torch's static rendezvous, store bound as above
ELASTIC = (C10D, ETCD)  # the dynamic ones: hosts may come and go
# A member silent for keep_alive_interval * keep_alive_max_attempt seconds is lost; once
# the minimum of hosts has met, the rendezvous waits last_call_timeout for more.
ELASTIC_DEFAULTS = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3",
                    "last_call_timeout": "2"}
DEFAULT_PORT = 29400  # torchrun's default c10d port
_UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL)


# ------------------------------------------------------------------ listening sockets
def bind_address(host: str, multi_node: bool) -> str:
    """The address a store that ``host`` names should listen on ("" for every one): the
    address ``host`` resolves to here; on one node loopback when it cannot be resolved;
    on several every address when it resolves to loopback (the other nodes resolve the
    name for themselves and cannot reach a loopback address)."""
    try:
        addr = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return "" if multi_node else "127.0.0.1"
    if multi_node and ipaddress.ip_address(addr.split("%")[0]).is_loopback:
        return ""
    return addr


def listening_store(addr: str, port: int, timeout: timedelta):
    """A TCPStore server that listens on ``addr`` only ("": every address)."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        why = (err.strerror or str(err)).lower()
        raise ConfigError(f"cannot open the rendezvous store at {addr or '*'}:{port} ({why}: "
                          "cannot listen there); pick a free port") from None
    port = sock.getsockname()[1]
    # The store takes the socket over; its own client connects to it like any other.
    return TCPStore(addr or "127.0.0.1", port, is_master=True, multi_tenant=True,
                    wait_for_workers=False, timeout=timeout, master_listen_fd=sock.detach())


def _bound_handler_class(backend: str, multi_node: bool, timeout: timedelta):
    """ddpkit's elastic handler (``ddpkit.elastic.membership``) whose workers' store listens on
    one address and is new for every round."""
    from ddpkit.elastic.membership import ElasticHandler

    class BoundHandler(ElasticHandler):
        def _create_tcp_store_server(self, master_addr, master_port):
            return listening_store(bind_address(master_addr, multi_node), master_port,
                                   timeout)

        def next_rendezvous(self):
            self._shared_tcp_store_server = None  # a fresh store: no dead workers' keys
            self._bootstrap_store_info = None
            return super().next_rendezvous()

        def get_backend(self) -> str:
            return backend

    return BoundHandler


def _elastic(handler, params, backend: str, hosts_store: bool):
    """The handler torch's factory built, as ddpkit's; with the liveness of
    ``ddpkit.elastic.membership`` when the job may span several hosts."""
    from ddpkit.elastic.membership import adopt

    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    multi_node = params.max_nodes > 1
    handler.__class__ = _bound_handler_class(params.backend, multi_node, timeout)
    if multi_node:
        adopt(handler, backend, params.endpoint, hosts_store)
    return handler


def _create_c10d_handler(params):
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    is_host = params.get_as_bool("is_host", False)
    if is_host:
        store = listening_store(bind_address(host, params.max_nodes > 1), port, timeout)
    else:
        store = TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    return _elastic(handler, params, "c10d", hosts_store=is_host)


def _create_etcd_handler(params):
    """torch's etcd-v2 rendezvous (state and agents' store in etcd, python-etcd client):
    no host of the job holds them, so any host may be lost."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    return _elastic(handler, params, "etcd-v2", hosts_store=False)


def _create_static_handler(params):
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    class BoundStatic(static_tcp_rendezvous.StaticTCPRendezvous):
        def get_backend(self) -> str:
            return STATIC

    params.config["rank"] = int(params.config["rank"])  # a --rdzv-conf value is a string
    handler = static_tcp_rendezvous.create_rdzv_handler(params)
    handler.__class__ = BoundStatic
    if handler.rank == 0:  # the store host: the store it would make, bound
        handler._store = listening_store(bind_address(handler.master_addr, params.max_nodes > 1),
                                         handler.master_port, handler.timeout)
    return handler


def register() -> None:
    """Make :data:`C10D` and :data:`STATIC` known to torchrun's agent (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    registry.register(C10D, _create_c10d_handler)  # the same creator again is a no-op
    registry.register(ETCD, _create_etcd_handler)
    registry.register(STATIC, _create_static_handler)


def _with_conf(conf: str, item: str) -> str:
    return ",".join(filter(None, [conf, item]))


def use_bound_rendezvous(args, max_nodes: int) -> None:
    """Point torchrun's parsed command line at the bound handlers, where it asked for
    torch's c10d, etcd-v2 or static rendezvous (or for none: a single node on a free
    port); other backends (torch's older etcd) are left as they are. A job of several
    hosts on c10d or etcd-v2 gets ddpkit's elastic defaults where ``--rdzv-conf`` does
    not set them. After :func:`choose_network`."""
    register()
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and args.master_port is None and max_nodes == 1):
        # torchrun's own single-node default (``localhost:0``), on loopback.
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint = C10D, "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
        args.rdzv_conf = _with_conf(args.rdzv_conf, "is_host=1")
        args.local_addr = args.local_addr or "localhost"  # the workers' MASTER_ADDR
    elif args.rdzv_backend == "c10d":
        args.rdzv_backend = C10D
        if max_nodes == 1:  # torchrun would publish this host's name, maybe not loopback
            args.local_addr = args.local_addr or "localhost"
    elif args.rdzv_backend == "static":
        # What torchrun's own static path reads from these flags, given to it directly.
        port = 29500 if args.master_port is None else args.master_port
        args.rdzv_endpoint = args.rdzv_endpoint or f"{args.master_addr}:{port}"
        args.rdzv_conf = _with_conf(args.rdzv_conf, f"rank={args.node_rank}")
        args.rdzv_backend, args.node_rank = STATIC, 0  # node_rank now travels in the conf
    elif args.rdzv_backend == "etcd-v2":
        args.rdzv_backend = ETCD
    if args.rdzv_backend in ELASTIC and max_nodes > 1:
        args.rdzv_conf = elastic_conf(args.rdzv_conf)


def elastic_conf(conf: str) -> str:
    """``--rdzv-conf`` with ddpkit's detection defaults for what it leaves unset
    (:data:`ELASTIC_DEFAULTS`: torch's keys, torch's meaning)."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    given = _parse_rendezvous_config(conf)
    for key, value in ELASTIC_DEFAULTS.items():
        if key not in given:
            conf = _with_conf(conf, f"{key}={value}")
    return conf


# ------------------------------------------------------------------ reaching the first node
def wait_for_endpoint(host: str, port: int, timeout: float, hint: str) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise one ConfigError line if
    it cannot be reached, or does not answer within ``timeout`` seconds (a refused
    connection is retried: the first node may not have started yet). ``hint`` says
    which option sets the timeout."""
    start = time.monotonic()
    deadline = start + timeout
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, left))):
                return
        except socket.gaierror as err:
            raise ConfigError(f"cannot resolve the rendezvous host {host!r} ({err.strerror}); "
                              "give the first node's address") from None
        except OSError as err:
            last = err.strerror or str(err) or type(err).__name__
            if err.errno in _UNREACHABLE:
                raise ConfigError(
                    f"cannot reach the rendezvous at {host}:{port} ({last}, after "
                    f"{time.monotonic() - start:.1f} s): is the first node up, and is this "
                    "its address?") from None
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"the rendezvous at {host}:{port} did not answer within {timeout:g} s "
                f"({last}): is the first node started, with this address and port? "
                f"{hint}") from None
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def wait_for_first_node(args, timeout_flag: str) -> None:
    """On a node that joins another node's store: wait until it answers, or one line."""
    from torch.distributed.elastic.rendezvous.utils import (
        _parse_rendezvous_config,
        parse_rendezvous_endpoint,
    )

    conf = _parse_rendezvous_config(args.rdzv_conf)
    if args.rdzv_backend == C10D:
        joins = str(conf.get("is_host", "")).lower() not in ("1", "true", "yes", "y")
        timeout = float(conf.get("read_timeout", 60))
    elif args.rdzv_backend == STATIC:
        joins = int(conf.get("rank", 0)) != 0
        timeout = float(conf.get("timeout", 600))  # torch's static store timeout
        timeout_flag = "--rdzv-conf timeout=SECONDS"
    elif args.rdzv_backend == ETCD:  # every node is etcd's client
        joins, timeout = True, float(conf.get("read_timeout", 60))
    else:
        return
    if joins:
        default = 2379 if args.rdzv_backend == ETCD else DEFAULT_PORT
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default)
        wait_for_endpoint(host, port, timeout, f"({timeout_flag} sets the wait)")
