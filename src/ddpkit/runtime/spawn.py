"""``ddpkit.spawn``: run ``fn(world, *args)`` in N local processes (the tutorials' mp.spawn).

Each child joins a gloo/nccl group through a FileStore in a private temporary
directory, so parallel runs never fight over a port. A child's exception comes back to
the parent as :class:`SpawnError` naming the rank and carrying the child's traceback;
the remaining children are stopped rather than left hanging in a collective.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ddpkit.errors import DdpkitError

# How long survivors get to finish after a peer failed before they are terminated.
_GRACE_S = 5.0
# How long ranks that reported get to end by themselves: after its value a rank still
# tears down (the process group, multiprocessing's exit finalizers); a rank terminated
# there leaves what those would release (e.g. semaphores named to the resource tracker,
# which then warns of a leak).
_EXIT_S = 60.0


class SpawnError(DdpkitError, RuntimeError):
    """A spawned rank raised or died. ``rank`` says which; the message holds its traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def worker_env(rank: int, world_size: int, master_port: int | None = None) -> dict[str, str]:
    """The variables torchrun would set for a single-node job, so user code that reads
    them (or calls ``init_process_group("env://")`` itself) behaves as under torchrun."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    return env


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; a tiny race remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, fn, args, init_method, port, backend, timeout, results):
    from ddpkit.runtime import process_group

    os.environ.update(worker_env(rank, world_size, port))
    try:
        world = process_group.init(backend, init_method, timeout)
        value = fn(world, *args)
        results.put((rank, True, value))
    except BaseException as exc:  # reported to the parent, which decides what to raise
        text = "".join(traceback.format_exception(exc))
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{text}"))
    finally:
        process_group.shutdown()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    backend: str = "auto",
    timeout: float | None = None,
    rendezvous: str = "file",
) -> list[Any]:
    """Run ``fn(world, *args)`` on ``nprocs`` ranks; return each rank's value, by rank.

    ``fn`` must be importable by name (defined at module level), as with mp.spawn.
    ``rendezvous``: "file" (a FileStore in a private temp dir: no port at all), "env"
    (MASTER_ADDR/MASTER_PORT on a free port) or "tcp" (``tcp://127.0.0.1:<free port>``).
    """
    if rendezvous not in ("file", "env", "tcp"):
        raise DdpkitError(f"rendezvous must be file, env or tcp, got {rendezvous!r}")
    if not isinstance(nprocs, int) or nprocs < 1:
        raise DdpkitError(f"nprocs must be a positive integer, got {nprocs!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ddpkit-spawn-") as tmp:
        port = free_port() if rendezvous != "file" else None
        init_method = {
            "file": f"file://{os.path.join(tmp, 'store')}",
            "env": "env://",
            "tcp": f"tcp://127.0.0.1:{port}",
        }[rendezvous]
        procs = [
            ctx.Process(
                target=_child,
                args=(r, nprocs, fn, args, init_method, port, backend, timeout, results),
                name=f"ddpkit-rank{r}",
            )
            for r in range(nprocs)
        ]
        for p in procs:
            p.start()
        reported = False
        try:
            values = _collect(procs, results)
            reported = True
            return values
        finally:
            _reap(procs, patient=reported)


def _reap(procs, *, patient: bool) -> None:
    """Join the ranks: after every rank reported, let each end by itself (up to
    :data:`_EXIT_S`); after a failure (or past that), terminate the ones still running."""
    deadline = time.monotonic() + _EXIT_S
    for p in procs:
        if patient:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
        p.join(timeout=10)


def _collect(procs, results) -> list[Any]:
    values: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    deadline = None
    while len(values) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue_mod.Empty:
            pass
        else:
            if ok:
                values[rank] = payload
            elif failure is None:
                failure, deadline = (rank, payload), time.monotonic() + _GRACE_S
            continue
        for rank, p in enumerate(procs):
            if rank in values or p.exitcode in (0, None):
                continue
            # Dead without a report: killed by a signal, or os._exit.
            if failure is None:
                failure = (rank, f"rank {rank} exited with code {p.exitcode} without reporting")
                deadline = time.monotonic() + _GRACE_S
        if failure and (time.monotonic() > deadline or all(not p.is_alive() for p in procs)):
            break
    if failure is not None:
        rank, text = failure
        raise SpawnError(rank, f"rank {rank} failed: {text}")
    return [values[r] for r in range(len(procs))]
