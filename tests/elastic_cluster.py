"""Test hosts for the elastic tests: network namespaces on one switch, and an etcd server.

Each host is a network namespace with one interface (``eth0``) whose other end is a port
of a bridge in a "switch" namespace of its own; the addresses are a 10.x.y.0/24 that no
route of this machine mentions. A host reaches the others only through the switch, so:

* **cut a host off the network**: its switch port goes down (:meth:`Cluster.cut`); its
  processes keep running, its TCP connections neither close nor answer, as when a cable
  is pulled; :meth:`Cluster.reconnect` brings the port back;
* **kill a host**: every process in its namespace gets SIGKILL (:meth:`Cluster.kill`),
  as when the machine dies: its peers' connections are reset.

The etcd server (``etcd --enable-v2``, Debian's etcd-server) runs inside the switch
namespace on the bridge's address, so no host's loss takes it along. Nothing here
listens or sends outside loopback and these namespaces.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import skip_unless_required

ETCD_PORT = 2379


def _ip(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _free_prefix() -> str:
    """A 10.a.b prefix that no route of this machine mentions."""
    used = _ip("-4", "route", "show", "table", "all").stdout
    for _ in range(100):
        prefix = f"10.{secrets.randbelow(55) + 200}.{secrets.randbelow(256)}"
        if prefix + "." not in used:
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 found")


@dataclass(frozen=True)
class TestHost:
    number: int  # 1-based, as a user counts hosts
    netns: str
    addr: str
    port: str  # this host's port on the switch (in the switch namespace)


def require_netns() -> None:
    """Skip (fail under DDPKIT_REQUIRE_ALL=1) where namespaces cannot be made."""
    if os.geteuid() != 0:
        skip_unless_required("network namespaces need root (run the suite as root to test "
                             "several hosts)")
    if shutil.which("ip") is None:
        skip_unless_required("`ip` (iproute2) is not installed; apt-get install iproute2")


def require_etcd() -> str:
    """The etcd server and the python-etcd client, or skip (fail under REQUIRE_ALL)."""
    etcd = shutil.which("etcd")
    if etcd is None:
        skip_unless_required("the etcd server is not installed (apt-get install etcd-server)")
    try:
        import etcd as _client  # noqa: F401  (python-etcd)
    except ImportError:
        skip_unless_required("python-etcd is not installed (pip install -e '.[test]')")
    return etcd


class Cluster:
    """``n`` hosts on one switch; :meth:`close` kills everything in them and removes them."""

    def __init__(self, n: int, workdir: Path):
        require_netns()
        token = secrets.token_hex(3)
        self.workdir = workdir
        self.prefix = _free_prefix()
        self.switch = f"ddpk-sw-{token}"
        self.switch_addr = f"{self.prefix}.254"
        self.hosts = [TestHost(i, f"ddpk-h{i}-{token}", f"{self.prefix}.{i}", f"p{i}")
                      for i in range(1, n + 1)]
        self._made: list[str] = []
        self._etcd: subprocess.Popen | None = None
        try:
            self._build()
        except RuntimeError as err:
            self.close()
            skip_unless_required(f"cannot build the test hosts: {err}")

    def _build(self) -> None:
        _ip("netns", "add", self.switch, check=True)
        self._made.append(self.switch)
        sw = ("-n", self.switch)
        _ip(*sw, "link", "add", "br0", "type", "bridge", check=True)
        _ip(*sw, "addr", "add", f"{self.switch_addr}/24", "dev", "br0", check=True)
        _ip(*sw, "link", "set", "br0", "up", check=True)
        _ip(*sw, "link", "set", "lo", "up", check=True)
        for host in self.hosts:
            _ip("netns", "add", host.netns, check=True)
            self._made.append(host.netns)
            _ip(*sw, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
                "netns", host.netns, check=True)
            _ip(*sw, "link", "set", host.port, "master", "br0", check=True)
            _ip(*sw, "link", "set", host.port, "up", check=True)
            hn = ("-n", host.netns)
            _ip(*hn, "addr", "add", f"{host.addr}/24", "dev", "eth0", check=True)
            _ip(*hn, "link", "set", "eth0", "up", check=True)
            _ip(*hn, "link", "set", "lo", "up", check=True)

    # ------------------------------------------------------------------ faults
    def pids(self, host: TestHost) -> list[int]:
        out = _ip("netns", "pids", host.netns).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill(self, host: TestHost) -> None:
        """Every process of ``host`` gets SIGKILL, as if the machine died."""
        for _ in range(20):  # a dying launcher may still fork: until none is left
            pids = self.pids(host)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def cut(self, host: TestHost) -> None:
        """``host`` loses the network: its switch port goes down."""
        _ip("-n", self.switch, "link", "set", host.port, "down", check=True)

    def reconnect(self, host: TestHost) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "up", check=True)

    # ------------------------------------------------------------------ etcd
    def start_etcd(self) -> str:
        """An etcd server (v2 API on) on the switch; its ``host:port`` endpoint."""
        etcd = require_etcd()
        data = self.workdir / "etcd-data"
        url = f"http://{self.switch_addr}:{ETCD_PORT}"
        log = (self.workdir / "etcd.log").open("w")
        self._etcd = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, etcd, "--enable-v2", "--data-dir", str(data),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", f"http://127.0.0.1:{ETCD_PORT + 1}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{ETCD_PORT + 1}",
             "--initial-cluster", f"default=http://127.0.0.1:{ETCD_PORT + 1}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            check = subprocess.run(
                ["ip", "netns", "exec", self.switch, "python3", "-c",
                 "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)",
                 self.switch_addr, str(ETCD_PORT)], capture_output=True, timeout=10)
            if check.returncode == 0:
                return f"{self.switch_addr}:{ETCD_PORT}"
            if self._etcd.poll() is not None:
                break
            time.sleep(0.2)
        log_text = (self.workdir / "etcd.log").read_text()
        raise AssertionError(f"etcd did not start: {log_text[-2000:]}")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._etcd is not None and self._etcd.poll() is None:
            os.killpg(self._etcd.pid, signal.SIGKILL)
            self._etcd.wait()
        for host in self.hosts:
            if host.netns in self._made:
                self.kill(host)
        for netns in reversed(self._made):  # a host's eth0 goes with its namespace
            _ip("netns", "del", netns)
        self._made.clear()


