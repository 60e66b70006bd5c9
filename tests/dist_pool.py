"""Long-lived gloo worker processes for tests.

Starting a process that imports torch costs seconds on this machine, so each world size
gets one pool of workers per test session, and the workers are forked from
multiprocessing's fork server, which imported torch and the pool's own modules once
(:data:`PRELOAD`): a worker starts with them imported instead of importing them again
(the environment it sees is the fork server's, taken when the session's first pool
started). ``pool.run(fn, *args)`` runs
``fn(world, *args)`` on every rank (``fn`` must be a module-level function) and returns
the results by rank. A task that fails or times out may leave other ranks stuck in a
collective, so the pool is then torn down and rebuilt on next use. A rank that dies (a
crash in native code, a kill) is a failure at once, named with its signal and its
threads' Python stacks at the crash (faulthandler), not a wait for the timeout; a
timeout first has every late rank write the stacks of all its threads, and the error
carries them, so a hang names the line each rank waits on.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import tempfile
import time
import traceback

# Imported once in the fork server: what every worker imports before its first task (see
# _worker), and torch._dynamo, which torch.optim imports at an optimizer's first step (in
# most workers, early in the session). With it already imported, ddpkit's DataParallel asks
# torch.compiler.is_compiling() instead of leaving it unasked (the same answer, False, in
# eager code); a launched process, which starts without it, keeps testing the other way.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ddpkit.runtime.process_group",
           "ddpkit.runtime.spawn"]


def stop_fork_server() -> None:
    """End the fork server (when every pool is closed): it reaped the workers, so their
    CPU time is counted with this process's children once it is waited for."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


class RankFailure(AssertionError):
    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


def _stacks_path(store_path: str, rank: int) -> str:
    return f"{store_path}.stacks-{rank}"


def _worker(rank, world_size, store_path, tasks, results):
    import faulthandler

    import torch

    from ddpkit.runtime import process_group
    from ddpkit.runtime.spawn import worker_env

    os.environ.update(worker_env(rank, world_size))
    # A fatal signal (SIGSEGV, SIGABRT, ...) and SIGUSR1 (sent by DistPool.run on a
    # timeout) write every thread's stack here, for the error the test reports.
    stacks = open(_stacks_path(store_path, rank), "w")  # noqa: SIM115 (open for life)
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    world = process_group.init("gloo", f"file://{store_path}", timeout=60)
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, seq = task
            try:
                results.put((seq, rank, True, fn(world, *args)))
            except BaseException as exc:
                results.put((seq, rank, False, "".join(traceback.format_exception(exc))))
    finally:
        process_group.shutdown()
    # Leave without finalizing the interpreter: torch's teardown costs each worker about
    # a second of CPU, and a session ends with ten of them on two cores. How a program
    # ends through finalization is tested by tests/test_clean_exit.py, not here.
    results.close()
    results.join_thread()
    os._exit(0)


class DistPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: list = []
        self._seq = 0
        self._asked_to_stop = False

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the fork server starts
        self._tmp = tempfile.mkdtemp(prefix=f"ddpkit-pool{self.world_size}-")
        store = self._store = os.path.join(self._tmp, "store")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, store, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 120.0) -> list:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._seq += 1
        for q in self._tasks:
            q.put((fn, args, self._seq))
        values, failures = {}, {}
        deadline = time.monotonic() + timeout
        failed_at = None
        while len(values) + len(failures) < self.world_size:
            now = time.monotonic()
            if failures and failed_at is None:
                failed_at = now
            # survivors may be stuck waiting for the failed rank: 3 s more at most
            remaining = (deadline if failed_at is None else min(deadline, failed_at + 3.0)) - now
            if remaining <= 0:
                break
            try:
                # in short waits: a rank that died answers nothing, so look for it
                seq, rank, ok, payload = self._results.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                failures.update(self._deaths(set(values) | set(failures)))
                continue
            if seq != self._seq:
                continue
            (values if ok else failures)[rank] = payload
        if failures or len(values) < self.world_size:
            stacks = "" if failures else self._stacks(sorted(set(range(self.world_size))
                                                             - set(values)))
            self.close()
            if failures:
                rank = min(failures)
                raise RankFailure(rank, failures[rank])
            missing = sorted(set(range(self.world_size)) - set(values))
            raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} within "
                               f"{timeout} s; their stacks:\n{stacks}")
        return [values[r] for r in range(self.world_size)]

    def _deaths(self, answered: set[int]) -> dict[int, str]:
        """rank -> why, for each rank that has not answered and whose process is gone."""
        dead = {}
        for rank, proc in enumerate(self._procs):
            if rank in answered or proc.is_alive():
                continue
            code = proc.exitcode
            how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exit code {code}")
            dead[rank] = (f"its process (pid {proc.pid}) died, {how}, during the task; what "
                          f"faulthandler wrote:\n{self._read_stacks(rank)}")
        return dead

    def _read_stacks(self, rank: int) -> str:
        try:
            with open(_stacks_path(self._store, rank)) as f:
                return f.read()
        except OSError as exc:
            return f"(nothing: {exc})"

    def _stacks(self, ranks: list[int]) -> str:
        """Every thread's Python stack in each of ``ranks`` (the ranks that are late)."""
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(1.0)  # faulthandler writes from the signal handler, at once
        return "\n".join(f"--- rank {rank} (pid {self._procs[rank].pid})\n"
                         f"{self._read_stacks(rank)}" for rank in ranks)

    def ask_to_stop(self) -> None:
        """Tell every worker to leave after its current task (close() then waits)."""
        if self._asked_to_stop:
            return
        self._asked_to_stop = True
        for q, p in zip(getattr(self, "_tasks", []), self._procs):
            if p.is_alive():
                q.put(None)

    def close(self) -> None:
        self.ask_to_stop()
        for p in self._procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        self._asked_to_stop = False
        if getattr(self, "_tmp", None):
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
