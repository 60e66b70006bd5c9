"""`ddpkit launch` takes torchrun's command lines with torchrun's meaning.

The reference is the installed torchrun (`python -m torch.distributed.run`): the same
command lines run under both, a probe script records what every rank saw (its launcher
environment, argv, `__name__`, module mode), and the records must be equal but for what
is fresh per run (ports, generated run ids, temp paths). Every flag of torchrun's parser
is read to the same value; bad inputs are one line and exit 2.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit import ConfigError, cli
from ddpkit.launcher import torchrun_args
from ddpkit.launcher.worker_heap import KEEP_LARGE_BLOCKS

PROBE = r"""
import json, os, sys
env = dict(os.environ)
record = {"env": env, "argv": sys.argv, "name": __name__,
          "module": getattr(__spec__, "name", None), "executable": sys.executable,
          "write_through": sys.stdout.write_through, "cwd": os.getcwd()}
attempt = env.get("TORCHELASTIC_RESTART_COUNT", "-")
out = os.path.join(env["PROBE_OUT"], f"attempt{attempt}.rank{env.get('RANK')}.json")
with open(out + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(out + ".tmp", out)  # whole when it appears (a peer waits for it below)
print(f"PROBE rank={env.get('RANK')} local={env.get('LOCAL_RANK')} attempt={attempt}", flush=True)
if env.get("PROBE_FAIL_ONCE") and attempt == "0" and env.get("RANK") == "1":
    # Fail only once rank 0 has written its record: the agent stops rank 0 as soon as
    # rank 1 exits, and under load rank 0 may not have got this far yet.
    import time
    peer = os.path.join(env["PROBE_OUT"], "attempt0.rank0.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(peer) and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(3)
"""

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DDPKIT_LAUNCH = [sys.executable, "-m", "ddpkit.cli", "launch"]
TIMEOUT_S = 120
# Set in the workers' environment by ddpkit only, on purpose: the CLI's logging mark
# (ddpkit's workers log to stderr, ddpkit/log.py) and, with --max-restarts, no rendezvous
# store shared between attempts (pytorch/pytorch#135712, see ddpkit/launcher/launch.py), which the
# workers see as TORCHELASTIC_USE_AGENT_STORE=False; and the file rank 0 writes its
# progress to for the launcher to draw (ddpkit/launcher/console.py); and the mark that turns a
# DdpkitError escaping the script into one line and exit 2 (ddpkit/errors.py).
# GLOO_SOCKET_IFNAME: a single-node run's gloo sockets on loopback only. The glibc
# settings that keep large freed blocks in the workers' heaps (ddpkit/launcher/worker_heap.py).
# DDPKIT_ENGINE: torch's DDP and CPU collectives made ddpkit's (ddpkit/launcher/engine_choice.py).
DDPKIT_ONLY_ENV = {"DDPKIT_CLI_LOGGING", "DDPKIT_PROGRESS_FILE", "DDPKIT_ONE_LINE_ERRORS",
                   "DDPKIT_LAUNCHER_PID", "GLOO_SOCKET_IFNAME", "DDPKIT_ENGINE",
                   *KEEP_LARGE_BLOCKS}
FRESH_PER_RUN = {"TORCHELASTIC_ERROR_FILE"}  # a temp directory of each agent
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def at_most_two_cpus() -> None:
    """`--nproc-per-node cpu|auto` means one process per usable CPU: keep that 2 here."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def base_env(out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
               "DDPKIT_CLI_LOGGING")}
    return {**env, "PROBE_OUT": str(out), "PYTHONUNBUFFERED": "1", **extra}


def run_both(argv_for, workdir: Path, **extra_env: str) -> dict[str, tuple]:
    """Run one command line under torchrun and under ``ddpkit launch`` at the same time
    (each in its own output directory, on its own free port; one's start-up fills the
    other's waits); return {"torchrun"|"ddpkit": (process, {(attempt, rank): record})}.
    ``argv_for(out)`` gives the command line with that launcher's output directory."""
    started = {}
    try:
        for name, launcher in (("torchrun", TORCHRUN), ("ddpkit", DDPKIT_LAUNCH)):
            out, port = workdir / name, free_port()
            out.mkdir()
            env = base_env(out, **extra_env)
            argv = [a.replace("{port}", str(port)) for a in argv_for(out)]
            proc = subprocess.Popen([*launcher, *argv], cwd=workdir, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    preexec_fn=at_most_two_cpus)
            started[name] = (proc, [*launcher, *argv], out, env, port)
        done = {}
        for name, (proc, command, out, env, port) in started.items():
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            records = {}
            for path in sorted(out.glob("attempt*.json")):
                raw = json.loads(path.read_text())
                key = tuple(path.name.removesuffix(".json").split("."))
                records[key] = normalise(raw, env, port)
            done[name] = (subprocess.CompletedProcess(command, proc.returncode, stdout, stderr),
                          records)
        return done
    finally:
        for proc, *_ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def normalise(raw: dict, parent_env: dict[str, str], port: int) -> dict:
    """What the launcher gave this rank: variables it added or changed, with the values
    that are fresh per run replaced by what they stand for."""
    seen = {}
    for key, value in raw["env"].items():
        if parent_env.get(key) == value or key in DDPKIT_ONLY_ENV or key in FRESH_PER_RUN:
            continue
        if key == "MASTER_PORT":
            value = "<given port>" if value == str(port) else "<free port>"
        elif key == "TORCHELASTIC_RUN_ID" and UUID.match(value):
            value = "<generated run id>"
        seen[key] = value
    return {**raw, "env": seen}


# Each command line combines spellings that do not interact (every spelling of every flag
# is also read against torchrun's own parser below, in process).
CASES = {
    # torchrun's own docs, PyTorch's DDP tutorial, and the spellings people copy from them.
    # (--run-path: torch's multiprocessing starts the ranks, which run the script by runpy)
    "standalone_run_path_nproc_cpu": ["--standalone", "--run-path", "--nproc-per-node", "cpu",
                                      "{workdir}/probe.py", "a", "--b=1"],
    # (module mode, the role, an elastic range and auto were a command line of their own)
    "c10d_endpoint_id_conf_module_role_elastic_range_nproc_auto": [
        "--nnodes", "1:1", "--nproc_per_node=auto", "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=job7",
        "--rdzv_conf=timeout=60,read_timeout=30", "--monitor_interval=0.2",
        "--role", "trainer", "-m", "probe", "x"],
    "static_master_addr_port_no_python": ["--master_addr=127.0.0.1", "--master-port", "{port}",
                                          "--node_rank=0", "--nnodes", "1", "--no_python",
                                          "--nproc-per-node=1", sys.executable, "probe.py", "y"],
    "max_restarts": ["--max_restarts=1", "--nproc-per-node", "2", "--monitor-interval", "0.1",
                     "probe.py"],
}


@pytest.mark.parametrize("case", CASES)
def test_same_command_line_same_ranks_as_torchrun(tmp_path, case):
    (tmp_path / "probe.py").write_text(PROBE)
    argv = [a.replace("{workdir}", str(tmp_path)) for a in CASES[case]]
    extra = {"PROBE_FAIL_ONCE": "1"} if case == "max_restarts" else {}
    runs = run_both(lambda out: argv, tmp_path, **extra)
    (ref, want), (ours, got) = runs["torchrun"], runs["ddpkit"]
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert ours.returncode == 0, ours.stderr[-3000:]

    nproc = min(2, len(os.sched_getaffinity(0))) if "cpu" in argv or any(
        "auto" in a for a in argv) else (1 if "--no_python" in argv else 2)
    ranks = {("attempt0", f"rank{r}") for r in range(nproc)}
    if case == "max_restarts":
        ranks |= {("attempt1", f"rank{r}") for r in range(nproc)}
    assert set(want) == ranks  # the reference itself ran what the command line says
    for key in sorted(want):
        assert got[key] == want[key], f"{case} {key}: {_diff(got[key], want[key])}"


def _diff(got: dict, want: dict) -> str:
    keys = sorted(set(got) | set(want))
    parts = [f"{k}: ddpkit {got.get(k)!r} != torchrun {want.get(k)!r}" for k in keys
             if k != "env" and got.get(k) != want.get(k)]
    env_keys = sorted(set(got["env"]) | set(want["env"]))
    parts += [f"env {k}: ddpkit {got['env'].get(k)!r} != torchrun {want['env'].get(k)!r}"
              for k in env_keys if got["env"].get(k) != want["env"].get(k)]
    return "; ".join(parts)


def test_output_options_same_console_and_log_files(tmp_path):
    """--log-dir, --redirects, --tee and --local-ranks-filter: the same lines on the
    console and the same log files as torchrun."""
    (tmp_path / "probe.py").write_text(PROBE)
    argv = ["--nproc-per-node", "2", "--log_dir", "{out}/logs", "--redirects", "0:2",
            "-t", "0:3,1:1", "--local_ranks_filter", "0", "--rdzv-id", "logs7",
            "--standalone", "probe.py"]
    runs = run_both(lambda out: [a.replace("{out}", str(out)) for a in argv], tmp_path)
    seen = {}
    for name, (proc, records) in runs.items():
        out = tmp_path / name
        assert proc.returncode == 0, proc.stderr[-3000:]
        console = sorted(line for line in proc.stdout.splitlines() if "PROBE" in line)
        logs = {}
        for path in sorted((out / "logs").rglob("*.log")):
            parts = path.relative_to(out / "logs").parts  # <run id>_<random>/attempt/rank/file
            logs["/".join(parts[1:])] = sorted(
                line for line in path.read_text().splitlines() if "PROBE" in line)
        seen[name] = (console, logs, sorted(records))
    assert seen["ddpkit"] == seen["torchrun"]
    console, logs, _ = seen["torchrun"]
    assert console == ["[default0]:PROBE rank=0 local=0 attempt=0"]  # rank 1 filtered out
    assert logs["attempt_0/0/stdout.log"] == ["PROBE rank=0 local=0 attempt=0"]


def test_failing_rank_is_named_with_its_role(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(5 if os.environ['RANK'] == '1' else 0)\n")
    proc = subprocess.run([*DDPKIT_LAUNCH, "--nproc_per_node=2", "--role", "learner",
                           str(script)], env=base_env(tmp_path), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "ddpkit launch: rank 1 failed first (exit code 5"), proc.stderr[-3000:]
    assert "prefixed [learner1]" in proc.stderr


# ---------------------------------------------------------------- the parser itself
# A value torchrun accepts for each option that takes one (keyed by dest).
VALUES = {
    "nnodes": "1:1", "nproc_per_node": "1", "rdzv_backend": "c10d",
    "rdzv_endpoint": "localhost:1234", "rdzv_id": "job", "rdzv_conf": "timeout=5",
    "max_restarts": "2", "monitor_interval": "0.3", "event_log_handler": "console",
    "role": "r", "log_dir": "/tmp/x", "redirects": "1", "tee": "2",
    "local_ranks_filter": "0,1", "duplicate_stdout_filters": "a,b",
    "duplicate_stderr_filters": "c", "node_rank": "1", "master_addr": "10.1.1.1",
    "master_port": "1234", "local_addr": "10.2.2.2", "logs_specs": "x",
    "signals_to_handle": "SIGTERM,SIGUSR1", "shutdown_timeout": "5",
}


def torch_options():
    from torch.distributed.run import get_args_parser

    for action in get_args_parser()._actions:
        if action.option_strings and action.dest != "help":
            yield action


@pytest.mark.parametrize("action", list(torch_options()), ids=lambda a: a.dest)
def test_every_spelling_of_every_flag_reads_as_torchrun_reads_it(tmp_path, monkeypatch, action):
    from torch.distributed.run import parse_args

    for key in list(os.environ):
        if key.startswith("PET_"):
            monkeypatch.delenv(key)
    script = str(tmp_path / "train.py")
    Path(script).write_text("")
    if action.nargs == 0:
        words = []
        if action.dest == "no_python":
            script = sys.executable  # an executable, as --no-python wants
    else:
        value = action.choices[-1] if action.choices else VALUES.get(action.dest, "1")
        words = [value]
    for spelling in action.option_strings:
        argv = [spelling, *words, script, "--lr", "0.1"]
        ours, theirs = torchrun_args.parse(argv), parse_args(argv)
        assert getattr(ours, action.dest) == getattr(theirs, action.dest), spelling
        assert action.dest in ours.ddpkit_given or action.dest not in torchrun_args.DDPKIT_DEFAULTS
        assert (ours.training_script, ours.training_script_args) == (script, ["--lr", "0.1"])


def test_defaults_where_no_flag_is_given(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("PET_"):
            monkeypatch.delenv(key)
    script = str(tmp_path / "train.py")
    Path(script).write_text("")
    args = torchrun_args.parse([script])
    assert args.nproc_per_node == str(torchrun_args.default_nproc())
    assert (args.tee, args.redirects, args.monitor_interval) == ("3", "0", 0.1)  # torchrun's
    assert args.rdzv_backend == "static" and not args.rdzv_endpoint  # torch: a free port
    # an endpoint alone means c10d (torchrun's static would give every node rank 0) ...
    assert torchrun_args.parse(["--rdzv-endpoint", "h:1", script]).rdzv_backend == "c10d"
    # ... with --node-rank, torchrun's static rendezvous
    assert torchrun_args.parse(["--rdzv-endpoint", "h:1", "--node-rank", "1", script]
                               ).rdzv_backend == "static"
    assert torchrun_args.parse(["-r", "3", script]).tee == "0"  # redirected: no tee added
    monkeypatch.setenv("PET_NPROC_PER_NODE", "1")  # torchrun's environment form counts
    monkeypatch.setenv("PET_TEE", "1")
    args = torchrun_args.parse([script])
    assert (args.nproc_per_node, args.tee) == ("1", "1")


# ---------------------------------------------------------------- bad inputs
def one_error_line(capsys, argv) -> str:
    assert cli.main(["launch", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("ddpkit launch: error: "), lines[0]
    return lines[0]


def test_unknown_flag_is_one_line_as_torchrun_also_refuses_it(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    line = one_error_line(capsys, ["--nprocs-per-node", "2", str(script)])
    assert "unrecognized arguments: --nprocs-per-node" in line and "--help" in line
    from torch.distributed.run import parse_args  # torchrun's own parser, in this process

    with pytest.raises(SystemExit) as refused:
        parse_args(["--nprocs-per-node", "2", str(script)])
    assert refused.value.code == 2
    assert "unrecognized arguments: --nprocs-per-node" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_nproc_gpu_without_a_gpu_is_one_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    line = one_error_line(capsys, ["--nproc-per-node", "gpu", str(script)])
    assert "--nproc-per-node gpu: this machine has no usable CUDA GPU" in line


@pytest.mark.parametrize("nnodes", ["x", "4:2", "0", "1:2:3", "2:"])
def test_malformed_nnodes_is_one_line(tmp_path, capsys, nnodes):
    script = tmp_path / "train.py"
    script.write_text("")
    line = one_error_line(capsys, ["--nnodes", nnodes, str(script)])
    assert f"--nnodes {nnodes!r} is not N or MIN:MAX" in line


@pytest.mark.parametrize(("argv", "message"), [
    (["--nproc-per-node", "many"], "--nproc-per-node 'many' is not a positive integer"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["--rdzv-conf", "=1"], "--rdzv-conf '=1' is not KEY=VALUE"),
    (["--tee", "7"], "--tee '7' is not 0-3"),
    (["--local-ranks-filter", "a"], "--local-ranks-filter 'a' is not a comma-separated"),
    (["--nnodes", "2"], "--nnodes 2 needs the first node's address"),
    (["-m", "--no-python"], "--module and --no-python: give one"),
    ([], "no script given"),
])
def test_other_bad_inputs_are_one_line(tmp_path, capsys, argv, message):
    script = tmp_path / "train.py"
    script.write_text("")
    line = one_error_line(capsys, [*argv, str(script)] if argv else [])
    assert message in line


def test_no_python_program_must_exist(capsys):
    line = one_error_line(capsys, ["--no-python", "no-such-program-xyz"])
    assert "--no-python: 'no-such-program-xyz' is not an executable" in line


def test_parse_error_is_a_config_error_not_an_exit():
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        torchrun_args.parse(["--bogus", "x.py"])
