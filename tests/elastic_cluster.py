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

import collections
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from conftest import skip_unless_required
from ddpkit.loop.sample_ids import read_sample_logs

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
class NetHost:
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
        workdir.mkdir(parents=True, exist_ok=True)
        self.prefix = _free_prefix()
        self.switch = f"ddpk-sw-{token}"
        self.switch_addr = f"{self.prefix}.254"
        self.hosts = [NetHost(i, f"ddpk-h{i}-{token}", f"{self.prefix}.{i}", f"p{i}")
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
    def pids(self, host: NetHost) -> list[int]:
        out = _ip("netns", "pids", host.netns).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill(self, host: NetHost) -> None:
        """Every process of ``host`` gets SIGKILL, as if the machine died."""
        for _ in range(20):  # a dying launcher may still fork: until none is left
            pids = self.pids(host)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def cut(self, host: NetHost) -> None:
        """``host`` loses the network: its switch port goes down."""
        _ip("-n", self.switch, "link", "set", host.port, "down", check=True)

    def reconnect(self, host: NetHost) -> None:
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




# ---------------------------------------------------------------------- a job on the hosts
DDPKIT = [sys.executable, "-m", "ddpkit.cli"]
EPOCHS, STEPS_PER_EPOCH = 8, 15  # digits: 1438 training samples, global batch 96
PAUSED_AT, CHECKPOINT = 34, 30  # every rank sleeps after step 34; a checkpoint every 10
REGROWN_AT = 50  # the second group parks here for a host to join


def exact_flags() -> list[str]:
    """Exact mode's options, in one place: 12 slices serve W = 1, 2, 3, 4, 6, 12."""
    return ["--exact", "--slices", "12"]


JOB = [*exact_flags(), "--batch-size", "96", "--epochs", str(EPOCHS), "--seed", "7",
       "--checkpoint-every-steps", "10", "--log-sample-ids", "--no-progress"]
PARK = {"DDPKIT_TEST_SLEEP_AT_STEP": f"{PAUSED_AT}:*:120"}
C10D_PORT = 29400  # inside the first host's own namespace: nothing else listens there


def launch_env(**extra: str) -> dict[str, str]:
    """The caller's environment without launcher, interface or fault variables."""
    drop = ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
            "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DDPKIT_HOST_ID")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_", "DDPKIT_TEST_"))}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


class ElasticJob:
    """One ``ddpkit train --nnodes MIN:MAX`` job on a :class:`Cluster`: the same command
    on every host (a host may be started again), each host's output in its own log."""

    def __init__(self, cluster: Cluster, run_dir: Path, train_args: list[str], *,
                 backend: str = "c10d", nnodes: str = "2:3", max_restarts: int = 3):
        self.cluster, self.run_dir, self.backend = cluster, run_dir, backend
        if backend == "etcd-v2":
            self.endpoint = cluster.start_etcd()
        else:
            self.endpoint = f"{cluster.hosts[0].addr}:{C10D_PORT}"
        self.argv = [*DDPKIT, "train", *train_args, "--nnodes", nnodes,
                     "--nproc-per-node", "1", "--max-restarts", str(max_restarts),
                     "--rdzv-backend", backend, "--rdzv-endpoint", self.endpoint,
                     "--rdzv-id", f"job-{cluster.prefix}", "--run-dir", str(run_dir)]
        self.procs: list[tuple[NetHost, subprocess.Popen, Path]] = []

    def start(self, host: NetHost, **env: str) -> subprocess.Popen:
        log = self.cluster.workdir / f"host{host.number}-{len(self.procs)}.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *self.argv], stdout=sink,
                stderr=subprocess.STDOUT, start_new_session=True,
                # each test host is a host of its own to ddpkit (no shared memory across)
                env=launch_env(DDPKIT_HOST_ID=f"test-host-{host.number}", **env))
        self.procs.append((host, proc, log))
        return proc

    def last(self, host: NetHost) -> tuple[subprocess.Popen, Path]:
        _, proc, log = [p for p in self.procs if p[0] == host][-1]
        return proc, log

    def log(self, host: NetHost) -> str:
        return self.last(host)[1].read_text(errors="replace")

    def wait(self, host: NetHost, timeout: float) -> int:
        proc, _ = self.last(host)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"host {host.number} still running after {timeout:g} s:\n"
                                 + self.log(host)[-3000:]) from None

    def close(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def last_step(run_dir: Path) -> int:
    """The newest step rank 0 logged in ``run_dir``'s sample log (0: none yet)."""
    try:
        lines = (run_dir / "sample_ids" / "rank0.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return max(steps, default=0)


def wait_until(what: str, predicate, timeout: float, job: ElasticJob | None = None) -> float:
    """Poll ``predicate`` until it holds; the time it first held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            logs = "" if job is None else "\n---\n".join(
                f"host {h.number}: {log.read_text(errors='replace')[-1500:]}"
                for h, _, log in job.procs)
            raise AssertionError(f"{what}: not within {timeout:g} s\n{logs}")
        time.sleep(0.05)
    return time.monotonic()


def assert_same_weights(run: Path, reference: Path) -> None:
    got = torch.load(run / "model.pt", weights_only=True)
    want = torch.load(reference / "model.pt", weights_only=True)
    assert got.keys() == want.keys()
    differ = [key for key in want if not torch.equal(got[key], want[key])]
    assert not differ, f"final weights differ from the uninterrupted run in {differ}"


def assert_every_step_once(run: Path, reference: Path) -> None:
    """Each step of the run trained on the reference's global batch (whatever ranks held
    it), each (step, rank) once: no step trained twice into the weights or skipped."""
    def by_step(path: Path) -> dict[int, list[int]]:
        records = read_sample_logs(path)
        keys = collections.Counter((r["step"], r["rank"]) for r in records)
        twice = [key for key, n in keys.items() if n > 1]
        assert not twice, f"(step, rank) logged twice: {twice[:5]}"
        steps: dict[int, list[int]] = collections.defaultdict(list)
        for r in records:
            steps[r["step"]] += r["ids"]
        return {step: sorted(ids) for step, ids in steps.items()}

    mine = by_step(run)
    assert sorted(mine) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert mine == by_step(reference)
