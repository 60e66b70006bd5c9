"""Run a program's ranks many times, quickly, each rank a real process that exits as a
user's would (through the interpreter's own finalization).

    python tests/repeat_launch.py [--runner] SCRIPT NRANKS RUNS [ARGS...]
    python tests/repeat_launch.py --jobs JSON

``--jobs`` takes a JSON list of ``{"script", "nranks", "runs", "args", "runner",
"preload"}`` and runs them one after the other from the same process.

Starting a process that imports torch costs seconds here, so one process imports torch,
torch.distributed and ddpkit once and forks every rank of every run of every job from
there (before any thread exists, so each child is a clean single-threaded copy). A job's
``preload`` modules are imported there too, before its first run, and stay for the jobs
after it: ``torch._dynamo`` for a program that builds an optimizer (torch.optim imports
it on first use, seconds of CPU per rank here). Not for every job: a rank's interpreter
finalizes every module it holds, so a preload costs each later run a little. Each child
becomes one rank of a ``torchrun``-like job (RANK, WORLD_SIZE, MASTER_ADDR/PORT on a
free port), runs SCRIPT as ``__main__``, then leaves by raising SystemExit to the top of
this program: the child's interpreter finalizes normally, atexit handlers included,
which is where an exit abort would happen. ``--runner`` runs SCRIPT through
``ddpkit.launcher.script_runner`` (what ``ddpkit launch`` does) instead of directly.

Prints one JSON line (with ``--jobs``, a list of them, one per job): per run, each
rank's exit code (negative: killed by that signal), the tail of its output, and the
names of the threads the rank still had when its last atexit handler ran (registered
here before anything else, so it runs after everyone else's, ddpkit's teardown
included): a process group's thread still alive then could abort the exit.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import socket
import sys
import tempfile
import types

THREADS_MARK = "repeat_launch: threads at exit:"


_PARENT = os.getpid()


def _report_threads() -> None:
    # Registered first, so it runs last (atexit is last-in, first-out); ranks only.
    if os.getpid() == _PARENT:
        return
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    print(f"{THREADS_MARK} {json.dumps(names)}", flush=True)


atexit.register(_report_threads)

# The job's ranks get one thread each, as torchrun gives them (OMP_NUM_THREADS=1); this
# also keeps BLAS from starting threads in the parent before it forks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402,F401  (imported once, inherited by every child)
import torch.distributed  # noqa: E402,F401

import ddpkit.comm  # noqa: E402,F401
import ddpkit.parallel  # noqa: E402,F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def become_rank(script: str, args: list[str], rank: int, nranks: int, port: int,
                run: int, log: str, runner: bool) -> None:
    """In the child: redirect output, set the launcher's variables, run the script."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nranks),
                      LOCAL_WORLD_SIZE=str(nranks), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"repeat-{os.getppid()}-{run}")
    if runner:
        from ddpkit.launcher import script_runner

        script_runner.main([script, *args])
        raise SystemExit(0)
    sys.argv = [script, *args]
    main = types.ModuleType("__main__")
    main.__file__ = script
    sys.modules["__main__"] = main
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    exec(code, main.__dict__)
    raise SystemExit(0)


def exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def repeat(script: str, nranks: int, runs: int, args: list[str],
           runner: bool = False) -> list[dict]:
    """Run the job ``runs`` times; its report (one entry per run)."""
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # a fork would copy a process whose other threads vanish
        raise SystemExit(f"repeat_launch: {len(threads)} threads before forking; need 1")
    tmp = tempfile.mkdtemp(prefix="ddpkit-repeat-")
    report = []
    for run in range(runs):
        port = free_port()
        children = []
        for rank in range(nranks):
            log = os.path.join(tmp, f"{run}-{rank}.log")
            pid = os.fork()
            if pid == 0:
                become_rank(script, args, rank, nranks, port, run, log, runner)
            children.append((pid, log))
        codes, tails, threads = [], [], []
        for pid, log in children:
            codes.append(exit_code(os.waitpid(pid, 0)[1]))
            with open(log, errors="replace") as f:
                text = f.read()
            os.unlink(log)
            tails.append(text[-600:])
            found = [json.loads(line[len(THREADS_MARK):]) for line in text.splitlines()
                     if line.startswith(THREADS_MARK)]
            threads.append(found[-1] if found else None)
        report.append({"codes": codes, "tails": tails, "threads": threads})
    os.rmdir(tmp)
    return report


if __name__ == "__main__":
    argv = sys.argv[1:]
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if argv[:1] == ["--jobs"] and len(argv) == 2:
        reports = []
        for job in json.loads(argv[1]):
            for module in job.get("preload", []):
                importlib.import_module(module)
            reports.append(repeat(job["script"], job["nranks"], job["runs"],
                                  job.get("args", []), job.get("runner", False)))
        print(json.dumps(reports), flush=True)
        raise SystemExit(0)
    use_runner = argv[:1] == ["--runner"]
    argv = argv[1:] if use_runner else argv
    if len(argv) < 3:
        raise SystemExit(__doc__)
    print(json.dumps(repeat(argv[0], int(argv[1]), int(argv[2]), argv[3:], use_runner)),
          flush=True)
