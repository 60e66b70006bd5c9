"""Process-group life cycle: init methods, idempotence, teardown, spawn, the logger."""

import logging

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit import ConfigError, SpawnError
from ddpkit.log import get_logger
from ddpkit.runtime.process_group import resolve_backend


def _sum_ranks(world, marker=None):
    t = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(t)
    if marker:
        _end_slowly(f"{marker}.{world.rank}")
    return world.rank, world.world_size, dist.get_backend(), t.item()


def _end_slowly(path):
    """A teardown after the rank's value was sent: multiprocessing runs this finalizer
    once the rank's function has returned (where it releases named semaphores too)."""
    import multiprocessing.util
    import pathlib
    import time

    def finish():
        time.sleep(0.3)
        pathlib.Path(path).write_text("ended")

    multiprocessing.util.Finalize(None, finish, exitpriority=10)


# Every init method, at two ranks and at three (each spawn starts its ranks afresh).
# Ranks that reported end by themselves: none is terminated in its teardown (that
# skipped multiprocessing's exit finalizers: a compiled function's tqdm lock leaked).
@pytest.mark.parametrize("rendezvous, nprocs", [("env", 2), ("tcp", 3), ("file", 3)])
def test_init_methods(rendezvous, nprocs, tmp_path):
    out = ddpkit.spawn(_sum_ranks, nprocs, args=(str(tmp_path / "ended"),),
                       rendezvous=rendezvous)
    expected = nprocs * (nprocs + 1) / 2
    assert out == [(r, nprocs, "gloo", expected) for r in range(nprocs)]
    assert [(tmp_path / f"ended.{r}").read_text() for r in range(nprocs)] == ["ended"] * nprocs


def _raise_on_rank_one(world, message):
    if world.rank == 1:
        raise KeyError(message)
    dist.barrier()  # rank 0 waits on a peer that never comes: spawn must not hang
    return "unreachable"


def test_spawn_reraises_child_exception_with_rank():
    with pytest.raises(SpawnError, match=r"rank 1 failed: KeyError: 'from-child'") as info:
        ddpkit.spawn(_raise_on_rank_one, 2, args=("from-child",), timeout=30)
    assert info.value.rank == 1
    assert "_raise_on_rank_one" in str(info.value)  # the child's traceback travels


def test_spawn_rejects_bad_nprocs():
    with pytest.raises(ddpkit.DdpkitError, match="nprocs"):
        ddpkit.spawn(_sum_ranks, 0)


def test_single_process_init_is_idempotent_and_torn_down(clean_env):
    with ddpkit.distributed() as world:
        assert dist.is_initialized() and world.world_size == 1
        assert ddpkit.init() is world  # second init returns the same World
        t = torch.ones(3)
        dist.all_reduce(t)  # a real group of one: collectives just work
        assert t.tolist() == [1.0, 1.0, 1.0]
    assert not dist.is_initialized()
    ddpkit.shutdown()  # safe when nothing is initialized


def test_context_manager_tears_down_on_error(clean_env):
    with pytest.raises(RuntimeError, match="inside"), ddpkit.distributed():
        raise RuntimeError("inside")
    assert not dist.is_initialized()


def test_bad_init_method_and_timeout(clean_env):
    with pytest.raises(ConfigError, match="init method"):
        ddpkit.init(init_method="udp://x")
    with pytest.raises(ConfigError, match="timeout must be positive"):
        ddpkit.init(timeout=0)
    assert not dist.is_initialized()


def test_backend_follows_device():
    assert resolve_backend("auto", "cpu") == "gloo"
    with pytest.raises(ConfigError, match="unknown backend"):
        resolve_backend("carrier-pigeon", "cpu")


def test_logger_prefixes_rank_and_filters(clean_env, caplog):
    logger = get_logger("ddpkit.test")
    with caplog.at_level(logging.INFO, logger="ddpkit"):  # pytest hooks the ddpkit logger
        logger.info("hello")
        clean_env.setenv("RANK", "1")
        logger.info("hidden on rank 1")
        logger.info("shown", all_ranks=True)
        clean_env.setenv("RANK", "0")
        logger.warning_once("once")
        logger.warning_once("once")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["[rank 0] hello", "[rank 1] shown", "[rank 0] once"]


def _bad_rendezvous(env: dict, timeout: float) -> str:
    """Run ddpkit.init in a fresh interpreter under ``env``; return its one error line."""
    import os
    import subprocess
    import sys

    code = (
        "import ddpkit, sys\n"
        "try:\n"
        f"    ddpkit.init(timeout={timeout})\n"
        "except ddpkit.ConfigError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_port_in_use_is_one_line():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        line = _bad_rendezvous(env, timeout=5)
    assert "port already in use" in line and f"MASTER_PORT={port}" in line


def test_world_size_mismatch_is_one_line():
    from ddpkit.runtime.spawn import free_port

    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    line = _bad_rendezvous(env, timeout=2)
    assert line.startswith("only 1 of WORLD_SIZE=2 processes joined within 2 s")


def _groups_built_again_on_one_store(world, port):
    """Three default groups in a row on a store that outlives each, as torchrun's agent
    store outlives the groups of the program it launched; a preemption stop in the last."""
    import os
    import signal
    import time

    from ddpkit.fault import PreemptionGuard

    ddpkit.shutdown()  # spawn's own group, on a store of its own
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    sums, stopped_at = [], None
    for build in range(3):
        if build and world.rank == 0:
            time.sleep(0.5)  # rank 1 looks for rank 0's address first: only the old one is there
        with ddpkit.distributed(backend="gloo", timeout=20) as again:
            t = torch.tensor([float(again.rank + 1)])
            dist.all_reduce(t)
            sums.append(t.item())
            if build == 2:
                with PreemptionGuard() as guard:
                    for step in range(1, 10):
                        if step == 2 and again.rank == 1:
                            os.kill(os.getpid(), signal.SIGTERM)
                        if guard.should_stop(step):
                            stopped_at = step
                            break
    return sums, stopped_at


def test_groups_built_again_in_the_same_ranks_meet_on_fresh_keys():
    # torchrun's agent store keeps the keys of the group before (pytorch/pytorch#55967).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = ddpkit.spawn(_groups_built_again_on_one_store, 2, (store.port,), timeout=60)
    assert out == [([3.0, 3.0, 3.0], 2)] * 2
