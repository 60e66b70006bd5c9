"""The parts of an elastic job that need no hosts: the writer fence, the host's lease, the
step note, the change line, the rendezvous defaults and the etcd client check."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint import Checkpointer, CheckpointError
from ddpkit.elastic import host_change, rendezvous
from ddpkit.elastic.host_lease import Lease
from ddpkit.elastic.writer_fence import GENERATION_ENV, StaleWriterError, claim, held
from ddpkit.errors import ConfigError
from ddpkit.launcher import torchrun_args
from ddpkit.launcher.launch import LaunchOptions, torchrun_argv

SCRIPT = str(Path(__file__).resolve())


# ------------------------------------------------------------------------ writer fence
def test_a_newer_generation_takes_the_directory_over_and_the_older_cannot_write(
        tmp_path, monkeypatch):
    monkeypatch.setenv(GENERATION_ENV, "job:1")
    claim(tmp_path)
    with held(tmp_path):
        pass
    monkeypatch.setenv(GENERATION_ENV, "job:2")
    claim(tmp_path)
    monkeypatch.setenv(GENERATION_ENV, "job:1")
    stale = pytest.raises(StaleWriterError, match="round 1 of job 'job', and round 2 has taken")
    with stale, held(tmp_path):
        pytest.fail("a stale generation entered the fence")
    with pytest.raises(StaleWriterError):
        claim(tmp_path)  # an old group starting late does not take it back
    monkeypatch.setenv(GENERATION_ENV, "another-job:0")
    claim(tmp_path)  # a new job (another rendezvous id) owns it from now on
    monkeypatch.delenv(GENERATION_ENV)
    with held(tmp_path):  # outside an elastic job there is nothing to fence
        pass


def test_a_checkpointer_of_a_replaced_group_refuses_to_write(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    monkeypatch.setenv(GENERATION_ENV, "job:0")
    old = Checkpointer(directory)
    old.save({"w": torch.ones(2)}, step=10)
    monkeypatch.setenv(GENERATION_ENV, "job:1")
    Checkpointer(directory)  # the new group's rank 0 claims the directory
    monkeypatch.setenv(GENERATION_ENV, "job:0")
    with pytest.raises(CheckpointError, match="has taken the run over"):
        old.save({"w": torch.zeros(2)}, step=20)
    assert [info.step for info in old.checkpoints()] == [10]
    assert not any(p.name.startswith(".") and "tmp" in p.name for p in directory.iterdir())


# ------------------------------------------------------------------------------ lease
def test_a_lease_expires_once_when_contact_stops_and_not_while_it_is_renewed():
    fired: list[float] = []
    lease = Lease(0.2, fired.append, poll=0.01)
    lease.arm()
    end = time.monotonic() + 0.4
    while time.monotonic() < end:  # contact every 0.03 s
        lease.renew()
        time.sleep(0.03)
    assert not fired
    time.sleep(0.35)
    assert len(fired) == 1 and fired[0] > 0.2
    assert lease.expired
    lease.arm()
    lease.disarm()  # work over: silence no longer matters
    time.sleep(0.3)
    assert len(fired) == 1
    lease.close()


# --------------------------------------------------------------------- note and line
def test_the_step_note_says_the_step_and_how_the_workers_ended(tmp_path):
    path = str(tmp_path / "note")
    assert host_change.read_note(path) is None
    note = host_change.StepNote(path)
    note.write(7)
    assert host_change.read_note(path) == (7, host_change.RUNNING)
    note.write(9, host_change.FINISHED)
    assert host_change.read_note(path) == (9, host_change.FINISHED)
    note.close()


def test_the_change_line_names_the_hosts_and_the_steps():
    lost = {"lost": ["10.0.0.3"], "joined": [], "hosts": 2, "after_step": 1005}
    assert host_change.change_line(lost, 990) == (
        "host 10.0.0.3 lost after step 1005; continuing on 2 hosts from step 990")
    both = {"lost": ["10.0.0.2", "10.0.0.3"], "joined": ["10.0.0.9"], "hosts": 1,
            "after_step": None}
    assert host_change.change_line(both, 0) == (
        "hosts 10.0.0.2, 10.0.0.3 lost and host 10.0.0.9 joined; continuing on 1 host "
        "from step 0")


def test_a_lost_peer_ends_a_worker_quietly_only_in_an_elastic_job(monkeypatch):
    def peer_gone() -> int:
        raise RuntimeError("[pair.cc:537] Read error [10.0.0.3]:6787: Connection reset by peer")

    monkeypatch.delenv(host_change.STEP_NOTE_ENV, raising=False)
    with pytest.raises(RuntimeError):
        host_change.quiet_if_peer_lost(peer_gone)
    monkeypatch.setenv(host_change.STEP_NOTE_ENV, "/nonexistent")
    assert host_change.quiet_if_peer_lost(peer_gone) == host_change.EXIT_PEER_LOST
    with pytest.raises(ValueError):  # anything else keeps its traceback
        host_change.quiet_if_peer_lost(lambda: int("x"))
    assert host_change.group_round({GENERATION_ENV: "job-1:3"}) == 3
    assert host_change.group_round({}) == 0


# ------------------------------------------------------------------ rendezvous options
def test_elastic_defaults_fill_only_what_rdzv_conf_leaves_open():
    conf = rendezvous.elastic_conf("is_host=1,keep_alive_interval=5")
    items = dict(item.split("=") for item in conf.split(","))
    assert items == {"is_host": "1", "keep_alive_interval": "5", "keep_alive_max_attempt": "3",
                     "last_call_timeout": "2"}


def test_etcd_v2_reaches_torchrun_without_a_store_host():
    argv = torchrun_argv(LaunchOptions(nnodes="2:3", rdzv_endpoint="203.0.113.9:2379",
                                       rdzv_backend="etcd-v2"), 1)
    assert argv[argv.index("--rdzv-backend") + 1] == "etcd-v2"
    assert "is_host=1" not in " ".join(argv)


def test_etcd_without_its_client_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "etcd" else real(name, *a))
    with pytest.raises(ConfigError, match="needs the python-etcd client: pip install"):
        torchrun_args.parse(["--nnodes", "2", "--rdzv-backend", "etcd-v2",
                             "--rdzv-endpoint", "127.0.0.1:2379", SCRIPT])



def test_a_launcher_step_note_is_its_own_and_dead_launchers_notes_are_removed(
        tmp_path, monkeypatch):
    import subprocess
    import tempfile

    from ddpkit.elastic import membership

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has any more
    stale = tmp_path / f"ddpkit-step-note-{gone.pid}"
    stale.write_bytes(b"x")
    path = membership._fresh_note_path()
    assert path == str(tmp_path / f"ddpkit-step-note-{os.getpid()}")
    assert Path(path).read_bytes() == b"" and not stale.exists()
