"""Two real hosts on one machine: network namespaces joined by a veth pair.

Each namespace has its own interfaces, routes and ports, so a node inside one reaches the
other only over the veth pair, exactly as two machines on a wire. One `ddpkit launch`
node runs in each over torchrun's real c10d rendezvous; the trained parameters must
equal those of a one-node, two-process run bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from chaos_harness import hex_address
from conftest import ROOT, skip_unless_required
from ddpkit.launcher.launch import LaunchOptions, route_to, torchrun_argv

DDPKIT = [sys.executable, "-m", "ddpkit.cli"]
NODE_TIMEOUT_S = 120


def child_env(**extra: str) -> dict[str, str]:
    """The caller's environment minus anything that would pick ranks or interfaces for us."""
    drop = ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
            "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_"))}
    # One intra-op thread everywhere: torchrun sets it only for >1 process per node, and a
    # different thread count changes float summation order, so results differ in the last bit.
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


TRAIN_ARGS = ("--epochs", "2", "--seed", "7", "--threads", "1", "--no-progress")
# measured, not computed: they differ between identical runs
TIMING_KEYS = {"samples_per_s", "time_s", "train_time_s", "rank_peak_rss_mib"}


def the_run(out_dir: Path) -> Path:
    runs = sorted(p for p in Path(out_dir).iterdir() if p.is_dir())
    assert len(runs) == 1, f"expected one run directory in {out_dir}, found {runs}"
    return runs[0]


def train_results(out_dir: Path) -> list[dict]:
    """Every epoch's losses and accuracies (timings dropped) of the one run in ``out_dir``."""
    lines = (the_run(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def final_model(out_dir: Path) -> dict[str, torch.Tensor]:
    """The trained weights the run saved (``model.pt``, documented in docs/training.md)."""
    return torch.load(the_run(out_dir) / "model.pt", map_location="cpu", weights_only=True)


def reference_run(train_reference) -> Path:
    """The uninterrupted 1-node, 2-process run of ``ddpkit train`` with TRAIN_ARGS, as an
    --out-dir holding its one run directory; the multi-node, SLURM and MPI tests, which
    launch that job their way, must all reproduce it bit for bit. It is trained once a
    session on 2 pooled ranks (the ``train_reference`` fixture: the worker entry's own
    options, the same bits without a launcher's start-up), so each of those launches is
    compared with the Trainer's own result, not with another launch."""
    return train_reference(2, list(TRAIN_ARGS)).parent


def assert_same_training(got_out: Path, want_out: Path) -> None:
    """Bit-for-bit the same final parameters and buffers (``torch.equal`` on every key of
    model.pt), which holds only if every rank saw the right shard and every gradient sum
    came out the same; and the same per-epoch losses and accuracies, as floats."""
    got, want = final_model(got_out), final_model(want_out)
    assert sorted(got) == sorted(want) and want
    differ = [key for key in want if not torch.equal(got[key], want[key])]
    assert not differ, f"final parameters differ from the one-node run in {differ}"
    got_epochs, want_epochs = train_results(got_out), train_results(want_out)
    assert len(got_epochs) == len(want_epochs) == 2
    for epoch_got, epoch_want in zip(got_epochs, want_epochs):
        assert epoch_got == epoch_want


def world_lines(output: str) -> list[dict]:
    # Each record is flat JSON, so "{...}" without nested braces finds it even where
    # another rank's output landed on the same line.
    return [json.loads(record) for record in re.findall(r"WORLD (\{[^{}]*\})", output)]


def stop(proc: subprocess.Popen) -> None:
    """Stop a node we started (its own process group: the agent and its workers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class ListeningIn:
    """The TCP addresses listened on inside a network namespace, sampled while the block
    runs (/proc/net/tcp and tcp6 are per namespace)."""

    def __init__(self, netns: str):
        self.netns, self.seen = netns, set()
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.wait(0.3):
            out = _ip("netns", "exec", self.netns, "cat", "/proc/net/tcp",
                      "/proc/net/tcp6").stdout
            self.seen |= {hex_address(cols[1]) for cols in map(str.split, out.splitlines())
                          if len(cols) > 3 and cols[3] == "0A"}

    def __enter__(self) -> ListeningIn:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


# ----------------------------------------------------------------- two hosts fixture
@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str
    addr: str


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _free_subnet() -> str:
    """A 10.a.b.0/30 no route of this machine mentions (the pair lives in its own
    namespaces, so this is only belt and braces against confusing a reader of `ip`)."""
    used = _ip("-4", "route", "show", "table", "all").stdout
    for _ in range(100):
        prefix = f"10.{random.randint(200, 254)}.{random.randint(0, 255)}"
        if prefix + "." not in used:
            return prefix
    raise RuntimeError("no free 10.x.y.0/30 subnet found")


@pytest.fixture
def two_hosts(request) -> tuple[Host, Host]:
    if os.geteuid() != 0:
        skip_unless_required("network namespaces need root (run the suite as root to test "
                             "two hosts)")
    if shutil.which("ip") is None:
        skip_unless_required("`ip` (iproute2) is not installed; apt-get install iproute2")
    token = secrets.token_hex(3)  # unique per run: parallel runs never share names
    prefix = _free_subnet()
    hosts = (Host(f"ddpk-a-{token}", f"dka{token}", f"{prefix}.1"),
             Host(f"ddpk-b-{token}", f"dkb{token}", f"{prefix}.2"))

    def cleanup() -> None:
        for host in hosts:  # deleting a namespace also deletes the veth end inside it
            _ip("netns", "del", host.netns)
        _ip("link", "del", hosts[0].ifname)  # only if it never moved into its namespace

    request.addfinalizer(cleanup)
    first = _ip("netns", "add", hosts[0].netns)
    if first.returncode:
        skip_unless_required(f"cannot create a network namespace: {first.stderr.strip()}")
    steps = [("netns", "add", hosts[1].netns),
             ("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)]
    for host in hosts:
        steps += [("link", "set", host.ifname, "netns", host.netns),
                  ("-n", host.netns, "addr", "add", f"{host.addr}/30", "dev", host.ifname),
                  ("-n", host.netns, "link", "set", host.ifname, "up"),
                  ("-n", host.netns, "link", "set", "lo", "up")]  # agents talk to workers on lo
    for step in steps:
        done = _ip(*step)
        if done.returncode:
            command = "ip " + " ".join(step)
            skip_unless_required(f"cannot build the veth pair (`{command}`): "
                                 f"{done.stderr.strip()}")
    return hosts


def start_node(host: Host, endpoint: str, run_id: str, out: Path, log: Path) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", host.netns, *DDPKIT, "train", "--nnodes", "2",
           "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
           *TRAIN_ARGS, "--out-dir", str(out)]
    with log.open("w") as sink:
        return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)


# ---------------------------------------------------------------------------- tests
@pytest.mark.slow
@pytest.mark.netns
def test_two_hosts_over_veth_equal_one_host(two_hosts, tmp_path, train_reference):
    want = reference_run(train_reference)
    host_a, host_b = two_hosts
    # A fresh namespace has no other listener: a fixed port inside it cannot collide.
    endpoint = f"{host_a.addr}:29400"
    run_id = host_a.netns  # one job id shared by both nodes
    nodes, timed_out = [], False
    listening = ListeningIn(host_a.netns)
    try:
        for host in two_hosts:
            nodes.append(start_node(host, endpoint, run_id, tmp_path / host.netns,
                                    tmp_path / f"{host.netns}.log"))
        with listening:
            for node in nodes:
                node.wait(NODE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for node in nodes:
            stop(node)
    logs = [(tmp_path / f"{host.netns}.log").read_text() for host in two_hosts]
    assert not timed_out, f"nodes still running after {NODE_TIMEOUT_S} s:\n" + \
        "\n---\n".join(log[-2000:] for log in logs)
    for node, log in zip(nodes, logs):
        assert node.returncode == 0, log[-4000:]
    # Exposure: the store host listens on the address given (or loopback), never on all.
    assert listening.seen, "no listening socket sampled on the store host"
    assert all(addr.rsplit(":", 1)[0] in (host_a.addr, "127.0.0.1")
               for addr in listening.seen), listening.seen
    # The launcher chose each namespace's veth for gloo (no GLOO_SOCKET_IFNAME given).
    for host, log in zip(two_hosts, logs):
        assert f"GLOO_SOCKET_IFNAME={host.ifname} " in log, log[-2000:]
    # c10d numbers nodes by their address: A (.1, also the store host) holds global
    # rank 0, the only rank that writes a run directory.
    assert "2 rank(s) x 64 = global batch 128" in logs[0]
    assert not any((tmp_path / host_b.netns).iterdir())
    assert_same_training(tmp_path / host_a.netns, want)


@pytest.mark.unit
def test_route_to_own_address_names_its_interface():
    if shutil.which("ip") is None:
        skip_unless_required("`ip` (iproute2) is not installed; apt-get install iproute2")
    assert route_to("127.0.0.1") == ("127.0.0.1", "lo")


@pytest.mark.unit
def test_every_node_publishes_the_address_that_reaches_the_endpoint():
    """Without --local-addr torchrun would publish getfqdn() (often 'localhost'), which
    becomes MASTER_ADDR for every worker whenever that node sorts first."""
    remote = "203.0.113.9"  # TEST-NET-3: routed (if at all) like any outside address
    source, _ = route_to(remote)
    argv = torchrun_argv(LaunchOptions(nnodes="2", rdzv_endpoint=f"{remote}:29411"), 1)
    assert "is_host=1" not in argv
    if source is None:  # no route at all: nothing to publish, torchrun's default stays
        assert "--local-addr" not in argv
    else:
        assert argv[argv.index("--local-addr") + 1] == source != "127.0.0.1"
    given = torchrun_argv(LaunchOptions(nnodes="2", rdzv_endpoint=f"{remote}:29411",
                                        local_addr="10.9.8.7"), 1)
    assert given[given.index("--local-addr") + 1] == "10.9.8.7"
