"""Who is in an elastic job: torch's dynamic rendezvous (c10d or etcd-v2 backend) with
the liveness a job that loses and gains hosts needs.

torch's ``DynamicRendezvousHandler`` keeps the job's members in a state every host's
agent reads and writes through the backend, each host refreshing its heartbeat there;
a host silent for ``keep_alive_interval * keep_alive_max_attempt`` is dropped when the
state is next read. torchrun's agent acts on two signals only: its own workers failing,
and hosts *waiting* to join (``num_nodes_waiting``). ddpkit adds what the agent leaves
out (:class:`Membership`, beside torch's handler):

* **A lost member is a change of hosts.** ``num_nodes_waiting`` also counts the members
  of the running group that left it or went silent. The agent then stops its workers
  and meets the others again, without counting it as one of ``--max-restarts``; the
  workers are killed first (they wait in a collective on a peer that is gone, and a
  stop signal would wait out the agent's grace period).
* **A host that loses contact stops its workers** (:class:`ddpkit.elastic.host_lease.Lease`)
  before the others continue without it, and its launcher ends with one line.
* **Workers that failed or stopped because a peer was lost** are not a failure of
  their own (:class:`ElasticAgent`): when every failed worker only lost a peer
  (``host_change.EXIT_PEER_LOST``) or was killed, or the workers stopped at a step with a
  checkpoint, the agent waits up to one detection time for the change to show, then
  meets the others again, without using up a restart. A worker's own error is
  torchrun's usual failure at once. Workers whose job had finished (the step note says
  so) end the host's part successfully.
* **The exit barrier** waits for the members still alive, not for all of them (torch's
  waits up to 300 s for a host that died after the last step).
* **Generations.** Each group of workers is told its round (``writer_fence``), the
  step note's path and, after a change, which hosts were lost or joined
  (``host_change``).

Defaults (``ddpkit.elastic.rendezvous.ELASTIC_DEFAULTS``, where ``--rdzv-conf`` does not say):
a heartbeat every second, a member silent for 3 s is lost, 2 s of last call for more
hosts once the minimum has met. See docs/multinode.md for what they cost and how to change them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.utils.store import store_timeout

from ddpkit.elastic.host_change import (
    CHANGE_ENV,
    FINISHED,
    STEP_NOTE_ENV,
    STOPPED,
    read_note,
)
from ddpkit.elastic.host_lease import Lease
from ddpkit.elastic.writer_fence import GENERATION_ENV
from ddpkit.errors import DdpkitError
from ddpkit.exit_codes import EXIT_HOST_LOST, EXIT_PEER_LOST
from ddpkit.log import get_logger
from ddpkit.runtime.launcher_link import child_pids

log = get_logger(__name__)

EXIT_WAIT_S = 60.0  # the longest a finished host waits at the exit for a live peer
_UNREACHABLE = (RendezvousConnectionError, DistNetworkError, DistStoreError)
_pending: list[BaseException] = []  # raised in the main thread by the fence signal
_timers: list[threading.Timer] = []  # the hard exits behind it
_NOTE_PREFIX = "ddpkit-step-note-"


class HostLostError(DdpkitError):
    """This host cannot continue in the job: it lost contact with the rendezvous."""


def _fence_signal() -> int:
    return signal.SIGRTMIN + 8


def kill_workers() -> None:
    """SIGKILL every child of this launcher (its workers), now."""
    for pid in child_pids():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class Membership:
    """ddpkit's bookkeeping beside one torch handler (see the module's docstring)."""

    def __init__(self, handler: DynamicRendezvousHandler, backend: str, endpoint: str,
                 hosts_store: bool):
        settings = handler._settings
        self.handler, self.backend, self.endpoint = handler, backend, endpoint
        self.hosts_store = hosts_store
        self.interval = settings.keep_alive_interval.total_seconds()
        self.dead_after = self.interval * settings.keep_alive_max_attempt
        # About when the others drop this host, well before they resume (host_lease).
        self.lease = Lease(max(self.dead_after - self.interval / 2, self.interval), self._fence)
        self.members: dict = {}  # node -> rank in the round the workers run in
        self.round: int | None = None
        self.change_seen = False
        self.lost: HostLostError | None = None
        self.note_path = _fresh_note_path()
        holder = handler._state_holder
        sync = holder.sync

        def renewing_sync():  # every read or write that reached the backend renews
            before = holder._last_sync_time
            result = sync()
            if holder._last_sync_time != before:
                self.lease.renew()
            return result

        holder.sync = renewing_sync

    # ------------------------------------------------------------------ rounds
    def start_round(self, after_step: int | None) -> None:
        """The rendezvous completed: tell the next workers their round and any change."""
        state = self.handler._state_holder.state
        members = dict(state.participants)
        os.environ[GENERATION_ENV] = f"{self.handler._settings.run_id}:{state.round}"
        os.environ[STEP_NOTE_ENV] = self.note_path
        before = {node.addr for node in self.members}
        now = {node.addr for node in members}
        lost, joined = sorted(before - now), sorted(now - before)
        if self.members and (lost or joined):
            os.environ[CHANGE_ENV] = json.dumps({"lost": lost, "joined": joined,
                                                 "hosts": len(now), "after_step": after_step})
        else:
            os.environ.pop(CHANGE_ENV, None)
        self.members, self.round = members, state.round
        self.change_seen = False
        with open(self.note_path, "wb"):
            pass  # the new workers write their own
        self.lease.arm()

    def note(self) -> tuple[int, int] | None:
        return read_note(self.note_path)

    def changed(self, state) -> bool:
        """Whether the running group lost a member (left, or silent and dropped) or the
        job moved on to another round."""
        return state.round != self.round or any(n not in state.participants
                                                for n in self.members)

    def dead_members(self) -> int:
        handler = self.handler
        with handler._heartbeat_lock:
            handler._state_holder.sync()
            state = handler._state_holder.state
        return sum(node not in state.participants for node in self.members)

    def wait_for_change(self) -> bool:
        """Whether the hosts change within one detection time (a member lost or a host
        waiting): then workers that failed or stopped did so because of it."""
        deadline = time.monotonic() + self.dead_after + 3 * self.interval + 1
        while time.monotonic() < deadline:
            if self.handler.num_nodes_waiting() > 0:
                return True
            time.sleep(0.1)
        return False

    # ------------------------------------------------------------------ losing contact
    def lost_message(self, silent: float | None = None) -> str:
        ago = "" if silent is None else f" {silent:.1f} s ago"
        if self.backend == "c10d":
            return (f"this host lost contact with the rendezvous store at {self.endpoint}{ago} "
                    "and stopped its workers: either this host is cut off (the others go on "
                    "without it) or the first host, which holds the store under c10d, is "
                    "lost, which ends the job (--rdzv-backend etcd-v2 with an etcd server "
                    "survives the loss of any host)")
        return (f"this host lost contact with the rendezvous ({self.backend} at "
                f"{self.endpoint}){ago} and stopped its workers; the other hosts go on "
                "without it (run the same command again to rejoin)")

    def close(self) -> None:
        self.lease.close()
        with contextlib.suppress(OSError):
            os.unlink(self.note_path)

    def _fence(self, silent: float) -> None:
        kill_workers()
        self.lost = HostLostError(self.lost_message(silent))
        _pending.append(self.lost)
        os.kill(os.getpid(), _fence_signal())  # raised in the main thread
        # The main thread may be inside a blocking store call that no signal interrupts.
        timer = threading.Timer(3.0, _exit_now, args=(self.lost,))
        timer.daemon = True
        _timers.append(timer)
        timer.start()

    def exit_barrier(self, store, world_size: int) -> None:
        """Every live member has finished too (or EXIT_WAIT_S passed)."""
        self.lease.disarm()
        deadline = time.monotonic() + EXIT_WAIT_S
        try:  # a store that stops answering counts as gone after the detection time
            with store_timeout(store, self.dead_after + self.interval):
                self._wait_at_exit(store, world_size, deadline)
        except _UNREACHABLE:  # the store's host is gone: nobody is left to wait for
            self.lost = self.lost or HostLostError("the rendezvous store is gone")

    def _wait_at_exit(self, store, world_size: int, deadline: float) -> None:
        store.add("ddpkit/exit", 1)
        while store.add("ddpkit/exit", 0) + self.dead_members() < world_size:
            if time.monotonic() > deadline:
                log.warning(f"left the exit barrier after {EXIT_WAIT_S:g} s without "
                            "hearing from every host")
                return
            time.sleep(0.1)


def _fresh_note_path() -> str:
    """This launcher's step note, named by its pid; the notes of launchers that died
    without cleaning up (killed with their host) are removed here."""
    directory = Path(tempfile.gettempdir())
    for old in directory.glob(f"{_NOTE_PREFIX}*"):
        pid = old.name[len(_NOTE_PREFIX):]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                old.unlink()
    path = directory / f"{_NOTE_PREFIX}{os.getpid()}"
    path.write_bytes(b"")
    return str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit_now(err: BaseException) -> None:
    print(f"ddpkit launch: {err}", file=sys.stderr, flush=True)
    os._exit(EXIT_HOST_LOST)


class ElasticHandler(DynamicRendezvousHandler):
    """torch's handler; ``_ddpkit`` is its :class:`Membership` (set by :func:`adopt`
    for a job of several hosts)."""

    _ddpkit: Membership | None = None

    def next_rendezvous(self):
        m = self._ddpkit
        if m is None:
            return super().next_rendezvous()
        m.lease.disarm()  # no workers while the hosts meet
        note = m.note()
        try:
            info = super().next_rendezvous()
        except _UNREACHABLE as err:
            if not m.members:
                raise
            m.lost = HostLostError(m.lost_message())
            raise m.lost from err
        m.start_round(note[0] if note else None)
        return info

    def num_nodes_waiting(self) -> int:
        m = self._ddpkit
        if m is None:
            return super().num_nodes_waiting()
        if m.change_seen:
            return 1
        try:
            with self._heartbeat_lock:
                self._state_holder.sync()
                state = self._state_holder.state
        except _UNREACHABLE:
            return 0  # the lease decides whether this host lost contact
        if m.members and m.changed(state):
            m.change_seen = True
            kill_workers()  # they wait in a collective on a peer that is gone
            return 1
        return len(state.wait_list)

    def shutdown(self) -> bool:
        m = self._ddpkit
        if m is None:
            return super().shutdown()
        m.close()
        if m.lost is not None:  # nothing to close through a backend we cannot reach
            self._stop_heartbeats()
            return False
        closed = super().shutdown()
        with contextlib.suppress(*_UNREACHABLE):
            store = self._get_store()
            store.add("ddpkit/departed", 1)
            if m.hosts_store:  # the others close the rendezvous through this store
                deadline = time.monotonic() + 10
                while (store.add("ddpkit/departed", 0) + m.dead_members() < len(m.members)
                       and time.monotonic() < deadline):
                    time.sleep(0.1)
        return closed


def adopt(handler: ElasticHandler, backend: str, endpoint: str, hosts_store: bool) -> None:
    """Give an :class:`ElasticHandler` of a job of several hosts its :class:`Membership`
    (a handler without one behaves as torch's)."""
    handler._ddpkit = Membership(handler, backend, endpoint, hosts_store)


def _membership(handler) -> Membership | None:
    return handler._ddpkit if isinstance(handler, ElasticHandler) else None


class ElasticAgent(LocalElasticAgent):
    """torchrun's agent; with an :class:`ElasticHandler`, a change of hosts is not a
    failure and the exit barrier waits only for live hosts."""

    def _monitor_workers(self, worker_group) -> RunResult:
        result = super()._monitor_workers(worker_group)
        m = _membership(worker_group.spec.rdzv_handler)
        if m is None or result.state in (WorkerState.HEALTHY, WorkerState.INIT):
            return result
        note = m.note()
        if note is not None and note[1] == FINISHED:
            # The job is done; a peer that died since may have failed the goodbye.
            return result if result.state == WorkerState.SUCCEEDED else RunResult(
                state=WorkerState.SUCCEEDED)
        if result.state == WorkerState.SUCCEEDED:
            if note is None or note[1] != STOPPED:
                return result
        elif not all(f.exitcode in (EXIT_PEER_LOST, -signal.SIGKILL)
                     for f in result.failures.values()):
            return result  # a worker's own error: torchrun's restart, at once
        # Stopped, lost a peer or killed: most likely a change of hosts on its way.
        if m.wait_for_change():  # the loop's num_nodes_waiting now restarts the group
            return RunResult(state=WorkerState.HEALTHY)
        return result

    def _exit_barrier(self) -> None:
        m = _membership(self._worker_group.spec.rdzv_handler)
        if m is None:
            super()._exit_barrier()
        else:
            m.exit_barrier(self._store, self._worker_group.group_world_size)


@contextlib.contextmanager
def elastic_agent() -> Iterator[None]:
    """While torchrun runs: its agent is :class:`ElasticAgent`, and a host that lost
    contact raises :class:`HostLostError` in the main thread."""
    from torch.distributed.launcher import api

    def raise_pending(signum, frame):
        if _pending:
            raise _pending.pop()

    original = api.LocalElasticAgent
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(_fence_signal(), raise_pending) if main else None
    api.LocalElasticAgent = ElasticAgent
    try:
        yield
    finally:
        api.LocalElasticAgent = original
        if main:
            signal.signal(_fence_signal(), previous)
        for timer in _timers:  # the error reached the caller: no hard exit
            timer.cancel()
        _timers.clear()
