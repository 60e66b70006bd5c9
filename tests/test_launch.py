"""`ddpkit launch` end to end: real torchrun agent, examples' output lines, failures."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

# Imported with the module, not inside a test: torch's elastic loggers take the stderr of
# the moment they are made, which in a test is that test's capture, closed after it.
import torch.distributed.run  # noqa: F401

from conftest import ROOT
from ddpkit import ConfigError
from ddpkit.launcher.launch import LaunchOptions, torchrun_argv

DDPKIT = [sys.executable, "-m", "ddpkit.cli"]


def run_cli(*args, timeout=120):
    """``ddpkit ARGS``, as a user runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*DDPKIT, *args], cwd=ROOT, timeout=timeout, env=env,
                          capture_output=True, text=True)


def test_spmd_example_under_launch():
    proc = run_cli("launch", "--nproc-per-node", "2", "examples/01_spmd_main.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(
            rf"\[default{rank}\]:\[\d+\] Initializing process group with: "
            rf"\{{'MASTER_ADDR': '[^']+', 'MASTER_PORT': '\d+', 'RANK': '{rank}', "
            rf"'WORLD_SIZE': '2'\}}",
            proc.stdout,
        ), proc.stdout
        assert re.search(rf"\[default{rank}\]:\[\d+\] rank = {rank}, world_size = 2", proc.stdout)
    port = re.search(r"'MASTER_PORT': '(\d+)'", proc.stdout).group(1)
    assert port != "29500"  # standalone picked a free port


FAILING = """
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("boom-on-rank-1")
    dist.barrier()

main()
"""


def test_failing_rank_reported_once(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING)
    proc = run_cli("launch", "--nproc-per-node", "2", str(script))
    assert proc.returncode != 0
    both = proc.stdout + proc.stderr
    assert both.count("ValueError: boom-on-rank-1") == 1, both[-3000:]
    # Exit code 1, or SIGTERM when the agent stopped rank 1 while it was still winding
    # down after rank 0 had already seen the connection drop: rank 1 is the cause either way.
    assert "ddpkit launch: rank 1 failed first (" in proc.stderr, proc.stderr[-2000:]


def cli_in_process(argv, capfd, monkeypatch) -> tuple[int, str]:
    """``ddpkit ARGV`` in this process, for failures that come before any worker starts
    (the launcher's own checks); its exit code and everything written to stderr."""
    from ddpkit import cli

    monkeypatch.chdir(ROOT)
    environ = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals()
                if signal.getsignal(sig) is not None}
    try:
        code = cli.main(argv)
    finally:  # what a launcher may set up for itself, left as it was for the next tests
        os.environ.clear()
        os.environ.update(environ)
        for sig, handler in handlers.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
    return code, capfd.readouterr().err


def test_missing_script_is_one_line():
    proc = run_cli("launch", "--nproc-per-node", "2", "no/such/script.py")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddpkit launch: error: script 'no/such/script.py' does not exist; "
        "give the path of a Python file"
    ]


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_invalid_nproc(bad, capfd, monkeypatch):
    # In this process (the command's own exit code 2 is checked end to end just above).
    code, stderr = cli_in_process(["launch", "--nproc-per-node", bad,
                                   "examples/01_spmd_main.py"], capfd, monkeypatch)
    assert code == 2 and "--nproc-per-node must be a positive integer" in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


def test_multinode_argv_marks_local_endpoint_as_host():
    argv = torchrun_argv(LaunchOptions(nnodes="2", rdzv_endpoint="127.0.0.1:29411"), 1)
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert "is_host=1" in argv and argv[argv.index("--local-addr") + 1] == "127.0.0.1"
    remote = torchrun_argv(LaunchOptions(nnodes="2", rdzv_endpoint="203.0.113.9:29411"), 1)
    assert "is_host=1" not in remote  # a remote endpoint: this node is a client
    with pytest.raises(ConfigError, match="needs --rdzv-endpoint"):
        torchrun_argv(LaunchOptions(nnodes="2"), 1)
    with pytest.raises(ConfigError, match="not HOST:PORT"):
        torchrun_argv(LaunchOptions(nnodes="2", rdzv_endpoint="nohostport"), 1)


def _failure(exitcode, timestamp=100, message="", recorded=False):
    from types import SimpleNamespace

    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, message=message,
                           error_file_data={"message": message if recorded else "<NONE>"})


def test_root_cause_is_the_killed_rank_not_the_survivor_the_agent_stopped():
    from ddpkit.launcher.failure_report import root_cause

    # rank 1 was SIGKILLed; the agent then SIGTERMed rank 0 in the same second.
    assert root_cause({0: _failure(-15), 1: _failure(-9)})[0] == 1
    # rank 0's collective broke and it exited by itself, a second earlier on the clock.
    assert root_cause({0: _failure(1, timestamp=99), 1: _failure(-9)})[0] == 1


def test_root_cause_prefers_the_raiser_over_peers_that_lost_it():
    from ddpkit.launcher.failure_report import root_cause

    failures = {0: _failure(1, message="DistBackendError: Connection closed by peer"),
                1: _failure(1, message="ValueError: bad batch"),
                2: _failure(-15)}
    assert root_cause(failures)[0] == 1
    # An earlier failure still wins over a later one, whatever its kind.
    failures[0] = _failure(1, timestamp=99, message="Connection closed by peer")
    assert root_cause(failures)[0] == 0


def test_root_cause_is_the_raiser_even_when_the_agent_stopped_it_while_it_wound_down(capsys):
    from ddpkit.launcher.failure_report import report_failure, root_cause

    # Rank 1 raised and recorded it; rank 0 saw the connection drop and exited first, so
    # the agent SIGTERMed rank 1 during its interpreter shutdown (seen in CI).
    failures = {0: _failure(1, message="Connection closed by peer", recorded=True),
                1: _failure(-15, message="ValueError: boom", recorded=True)}
    assert root_cause(failures)[0] == 1
    for rank, failure in failures.items():
        failure.local_rank, failure.pid = rank, 1000 + rank
    assert report_failure(failures, "default") == 1
    line = capsys.readouterr().err.strip()
    assert line == ("ddpkit launch: rank 1 failed first (then stopped by SIGTERM, pid 1001); "
                    "its traceback is above, prefixed [default1]; ranks [0] failed after it")
    # ddpkit train on a terminal shows local rank 0's lines without their prefix
    assert report_failure({0: failures[0]}, "default", plain_rank0=True) == 1
    assert capsys.readouterr().err.strip().endswith("its traceback is above, not prefixed")
    assert report_failure(failures, "default", plain_rank0=True) == 1
    assert "prefixed [default1]" in capsys.readouterr().err  # rank 1 keeps its prefix
    # The other way round: rank 1 exited first, and rank 0, whose barrier broke, was
    # SIGTERMed after recording that; the lost connection is still not the cause.
    failures = {0: _failure(-15, message="Connection closed by peer", recorded=True),
                1: _failure(1, message="ValueError: boom", recorded=True)}
    assert root_cause(failures)[0] == 1
    # Both ranks raised a usage error (exit 2); rank 0, first, was SIGTERMed while it
    # wound down (seen in CI): the launch still exits 2, not 1.
    usage = {0: _failure(-15, message="UsageError: device_ids=[0]", recorded=True),
             1: _failure(2, message="UsageError: device_ids=[1]", recorded=True)}
    for rank, failure in usage.items():
        failure.local_rank, failure.pid = rank, 1000 + rank
    assert root_cause(usage)[0] == 0
    assert report_failure(usage, "default") == 2
    capsys.readouterr()
    # a peer that only lost the connection does not lend its code
    usage[1] = _failure(3, message="Connection closed by peer", recorded=True)
    usage[1].local_rank, usage[1].pid = 1, 1001
    assert report_failure(usage, "default") == 1
    capsys.readouterr()
    # torch's own record of a rank that wrote no error file reads as not recorded.
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddpkit.launcher.failure_report import _recorded

    assert not _recorded(ProcessFailure(local_rank=0, pid=1, exitcode=-15,
                                        error_file="/nonexistent/error.json"))
    # Without a recorded exception a SIGTERMed rank is a survivor the agent stopped.
    failures[1] = _failure(-15)
    assert root_cause(failures)[0] == 0


def test_rendezvous_port_in_use_is_one_line(capfd, monkeypatch):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, stderr = cli_in_process(["launch", "--nnodes", "1", "--rdzv-endpoint",
                                       f"127.0.0.1:{port}", "examples/01_spmd_main.py"],
                                      capfd, monkeypatch)
    assert code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert f"cannot open the rendezvous store at 127.0.0.1:{port}" in errors[0]
    assert "address already in use" in errors[0] and "pick a free port" in errors[0]


KILLED_RANK = """
import os, signal
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
"""


def test_a_killed_rank_is_named_not_the_survivor_the_agent_stopped(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RANK)
    proc = run_cli("launch", "--nproc-per-node", "2", str(script))
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("ddpkit launch: rank 1 was killed by SIGKILL"), summary
    assert summary.endswith("ranks [0] failed after it"), summary


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["train_c10d", "launch_static", "train_nobody_joins"])
def test_unreachable_rendezvous_is_one_line_without_frame_dumps(how, tmp_path, capfd,
                                                               monkeypatch):
    port = _free_port()  # nothing listens there: the "first node" never answers
    train = ["train", "--data", "synthetic", "--synthetic-size", "64", "--epochs", "1",
             "--run-dir", str(tmp_path / "run")]
    argv, expected = {
        "train_c10d": ([*train, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                        f"127.0.0.1:{port}", "--rdzv-timeout", "1"],
                       rf"ddpkit train: error: the rendezvous at 127\.0\.0\.1:{port} did not "
                       r"answer within 1 s \(Connection refused\): is the first node started, "
                       r"with this address and port\? \(--rdzv-timeout SECONDS sets the wait\)$"),
        "launch_static": (["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                           "127.0.0.1", "--master-port", str(port), "--rdzv-conf", "timeout=1",
                           "examples/01_spmd_main.py"],
                          rf"ddpkit launch: error: the rendezvous at 127\.0\.0\.1:{port} did not "
                          r"answer within 1 s \(Connection refused\): .* \(--rdzv-conf "
                          r"timeout=SECONDS sets the wait\)$"),
        "train_nobody_joins": ([*train, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                "--rdzv-timeout", "1"],
                               rf"ddpkit train: error: the rendezvous at 127\.0\.0\.1:{port} did "
                               r"not gather 2 nodes in time; start every node with the same "
                               r"--rdzv-endpoint and --rdzv-id \(--rdzv-timeout SECONDS sets the "
                               r"wait\)$"),
    }[how]
    # In this process: the failure comes before any worker starts, in the launcher (and
    # C++ writes its frame dumps to the process's stderr, which capfd reads).
    start = time.monotonic()
    code, stderr = cli_in_process(argv, capfd, monkeypatch)
    assert time.monotonic() - start < 30
    assert code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and re.search(expected, errors[0]), stderr[-3000:]
    assert "Traceback" not in stderr and "frame #" not in stderr
