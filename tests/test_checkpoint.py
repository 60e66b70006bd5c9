"""Checkpointer: atomic save, verified load with fallback, rotation, state round trips."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil

import numpy as np
import pytest
import torch

import ddpkit
from ddpkit.checkpoint import (
    Checkpointer,
    CheckpointError,
    collect_state,
    config_fingerprint,
    load_model_state,
    restore_state,
)


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 6, extra: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, hidden)
        self.fc2 = torch.nn.Linear(hidden, 3)
        self.norm = torch.nn.BatchNorm1d(3)  # a buffer (running stats) must round-trip too
        if extra:
            self.head = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.norm(self.fc2(torch.relu(self.fc1(x))))


class Wrapper(torch.nn.Module):
    """Stands in for ddpkit.DataParallel / torch DDP: the user's model under ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


class Counter:
    """Any object with state_dict/load_state_dict works as the sampler."""

    def __init__(self, position=0):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


@pytest.fixture
def warnings_seen():
    """Lines ddpkit logs at WARNING or above, caught by a handler on the "ddpkit" logger
    itself (whatever the root logger's level and handlers are)."""
    lines: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = ListHandler(logging.WARNING)
    root = logging.getLogger("ddpkit")
    ddpkit.log.get_logger("ddpkit")  # make sure the root handler exists first
    root.addHandler(handler)
    yield lines
    root.removeHandler(handler)


def trained(seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def small_state(value: float) -> dict:
    return {"w": torch.full((16,), value), "step": int(value)}


# ------------------------------------------------------------------ round trip
def test_full_state_round_trip_is_exact(tmp_path):
    model, opt, sched = trained()
    sampler = Counter(position=40)
    config = {"lr": 0.01, "model": {"hidden": 6}}
    state = collect_state(model=Wrapper(model), optimizer=opt, scheduler=sched, sampler=sampler,
                          step=3, epoch=1, config=config)
    # What the run draws next: a resumed run must draw exactly the same.
    expected_draws = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    path = ckpt.save(state, step=3)
    assert path.is_dir() and (path / "manifest.json").exists()

    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    model2 = Net()
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    sampler2 = Counter()
    loaded = ckpt.load_latest()
    info = restore_state(loaded, model=Wrapper(model2), optimizer=opt2, scheduler=sched2,
                         sampler=sampler2, config=config)
    assert info == {"step": 3, "epoch": 1, "world_size": 1, "rng_restored": True}
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    saved_state, restored_state = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert saved_state and saved_state.keys() == restored_state.keys()
    for key, st in saved_state.items():
        assert st.keys() == restored_state[key].keys() and "exp_avg" in st
        for name, value in st.items():
            assert torch.equal(value, restored_state[key][name])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert sched2.state_dict() == sched.state_dict()
    assert sampler2.position == 40
    assert torch.equal(torch.rand(5), expected_draws[0])
    assert np.array_equal(np.random.rand(5), expected_draws[1])
    assert [random.random() for _ in range(5)] == expected_draws[2]


def test_run_state_loads_with_plain_torch_weights_only(tmp_path):
    model, opt, sched = trained()
    state = collect_state(model=model, optimizer=opt, scheduler=sched, step=1,
                          config={"a": 1})
    path = Checkpointer(tmp_path).save(state, step=1)
    plain = torch.load(path / "run.pt", weights_only=True)  # raises if it needs code
    assert plain["in_dcp"] == ["model", "optimizer"] and "model" not in plain
    assert plain["scheduler"] == sched.state_dict() and plain["step"] == 1


def test_code_in_a_checkpoint_is_refused(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"payload": Counter(5)}, step=1)  # pickles a class: not weights-only
    with pytest.raises(CheckpointError,
                       match="refusing to load checkpoint .*weights_only=True") as err:
        ckpt.load_latest()
    assert "weights_only=False" not in str(err.value)  # never torch's advice to retry so


def test_damaged_file_loaded_directly_is_one_line(tmp_path):
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(small_state(1.0), step=1)
    (path / "run.pt").write_bytes((path / "run.pt").read_bytes()[:300])
    with pytest.raises(CheckpointError, match="damaged or not a checkpoint") as err:
        ckpt.load(path)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="not found on rank 0; .* every rank can read"):
        ckpt.load(tmp_path / "step_000000009.pt")


def test_seed_style_prefixed_state_dict_loads_into_plain_model():
    torch.manual_seed(0)
    source = Wrapper(Net())
    target = Net()
    load_model_state(target, source.state_dict())  # keys are "module.fc1.weight", ...
    for a, b in zip(source.module.parameters(), target.parameters()):
        assert torch.equal(a, b)


def test_other_model_error_lists_every_differing_key(tmp_path):
    state = collect_state(model=Net(hidden=6), step=0)
    other = Net(hidden=8, extra=True)
    with pytest.raises(CheckpointError) as err:
        restore_state(state, model=Wrapper(other))
    message = str(err.value)
    assert "\n" not in message
    assert "unexpected keys" not in message  # the checkpoint has nothing the model lacks
    assert "missing keys [head.weight, head.bias]" in message
    assert "fc1.weight (6, 4) vs model (8, 4)" in message
    assert "fc2.weight (3, 6) vs model (3, 8)" in message
    smaller = collect_state(model=Net(extra=True), step=0)
    with pytest.raises(CheckpointError, match=r"unexpected keys \[head.weight, head.bias\]"):
        restore_state(smaller, model=Net())


def test_config_change_is_named(tmp_path):
    config = {"lr": 0.1, "data": {"batch": 32}}
    state = collect_state(step=0, config=config)
    assert state["fingerprint"] == config_fingerprint(dict(config))
    restore_state(state, config={"data": {"batch": 32}, "lr": 0.1})  # key order is irrelevant
    with pytest.raises(CheckpointError, match=r"data.batch: 32 -> 64") as err:
        restore_state(state, config={"lr": 0.1, "data": {"batch": 64}})
    assert "lr" not in str(err.value).split("(")[1]


# ------------------------------------------------------------------ verification and fallback
def test_corrupt_latest_falls_back_with_warning(tmp_path, warnings_seen):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(small_state(1.0), step=1)
    path2 = ckpt.save(small_state(2.0), step=2)
    raw = bytearray((path2 / "run.pt").read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte
    (path2 / "run.pt").write_bytes(bytes(raw))
    assert ckpt.latest().step == 1
    assert torch.equal(ckpt.load_latest()["w"], torch.full((16,), 1.0))
    assert any("step_000000002: its file run.pt has a sha256 mismatch" in w
               and "falling back to step_000000001 (step 1)" in w
               for w in warnings_seen), warnings_seen


def test_truncated_and_missing_payloads_fall_back(tmp_path, warnings_seen):
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2, 3):
        ckpt.save(small_state(step), step=step)
    p3, p2 = ckpt.path_for(3), ckpt.path_for(2)
    (p3 / "run.pt").write_bytes((p3 / "run.pt").read_bytes()[:100])
    (p2 / "manifest.json").write_text("{not json")
    info = ckpt.latest()
    assert info.step == 1
    assert any("its file run.pt is truncated: 100 bytes" in w for w in warnings_seen)
    assert any("step_000000002: its manifest manifest.json is damaged" in w
               for w in warnings_seen)
    shutil.rmtree(ckpt.path_for(1))
    assert ckpt.latest() is None
    assert ckpt.load_latest() is None


def test_empty_directory_has_nothing_to_resume(tmp_path):
    assert Checkpointer(tmp_path / "new").load_latest() is None


# ------------------------------------------------------------------ rotation
def test_keep_k_rotation(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in range(5):
        ckpt.save(small_state(step), step=step * 10)
    names = sorted(os.listdir(tmp_path))
    assert names == ["step_000000030", "step_000000040"]
    assert ckpt.latest().step == 40
    keep_all = Checkpointer(tmp_path / "all", keep=None)
    for step in range(4):
        keep_all.save(small_state(step), step=step)
    assert [i.step for i in keep_all.checkpoints()] == [0, 1, 2, 3]


def test_keep_one_never_leaves_zero_and_resave_replaces(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(small_state(1.0), step=1)
    ckpt.save(small_state(2.0), step=2)
    assert [i.step for i in ckpt.checkpoints()] == [2]
    ckpt.save(small_state(5.0), step=2, reason="preempted")  # same step again
    info = ckpt.latest()
    assert (info.step, info.reason) == (2, "preempted")
    assert torch.equal(ckpt.load_latest()["w"], torch.full((16,), 5.0))
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["format"] == "ddpkit-checkpoint/2" and manifest["bytes"] == info.size


def test_every_checkpoint_appears_whole_by_rename_never_written_in_place(tmp_path, monkeypatch):
    """Atomic write: the step's directory is written under a hidden temporary name (its
    files too, each renamed into place) and the directory renamed to its final name last
    (the commit), so a reader or a crash never sees a half-written checkpoint."""
    from ddpkit.files import durable

    written, renamed = [], []
    real_open, real_replace = open, os.replace

    def recording_open(path, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax"):
            written.append(os.path.basename(path))
        return real_open(path, mode, *args, **kwargs)

    def recording_replace(src, dst):
        renamed.append((os.path.basename(src), os.path.basename(dst)))
        return real_replace(src, dst)

    # Every file of a checkpoint is written through ddpkit.files.durable.
    monkeypatch.setattr(durable, "open", recording_open, raising=False)
    monkeypatch.setattr(durable.os, "replace", recording_replace)
    model, opt, _ = trained()
    Checkpointer(tmp_path, keep=2).save(collect_state(model=model, optimizer=opt, step=7), step=7)
    finals = sorted(os.listdir(tmp_path))
    assert finals == ["step_000000007"]
    assert sorted(os.listdir(tmp_path / finals[0])) == [
        ".metadata", "__0_0.distcp", "manifest.json", "run.pt"]
    assert written and all(name.startswith(".") and ".tmp-" in name for name in written), written
    assert renamed[-1][1] == "step_000000007" and renamed[-1][0].startswith(".step_000000007.tmp-")
    assert {dst for _, dst in renamed[:-1]} == {"run.pt", "manifest.json"}


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(CheckpointError, match="keep must be >= 1"):
        Checkpointer(tmp_path, keep=0)


# ------------------------------------------------------------------ unwritable locations
@pytest.mark.parametrize("where", ["under_a_file", "sysfs", "is_a_file"])
def test_unwritable_directory_fails_before_training(tmp_path, where):
    blocker = tmp_path / "file"
    blocker.write_text("data")
    target = {"under_a_file": blocker / "ck", "sysfs": "/sys/ddpkit-ck", "is_a_file": blocker}
    with pytest.raises(CheckpointError, match="directory .* (not writable|is not a directory)"):
        Checkpointer(target[where])
    assert blocker.read_text() == "data"  # nothing overwritten


def test_write_failure_is_a_checkpoint_error_and_keeps_the_previous(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(small_state(1.0), step=1)
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
        ckpt.save({"fn": lambda: 0}, step=2)  # cannot be pickled
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
    assert ckpt.latest().step == 1


# ------------------------------------------------------------------ collective (2 ranks)
def _collective_round_trip(world, directory):
    torch.manual_seed(100 + world.rank)  # ranks draw different streams, like dropout does
    np.random.seed(100 + world.rank)
    random.seed(100 + world.rank)
    state_before = torch.get_rng_state()
    torch.manual_seed(7)
    model = Net()  # same parameters on every rank, as after DDP's broadcast
    torch.set_rng_state(state_before)
    ckpt = Checkpointer(directory, keep=2)
    state = collect_state(model=model, step=5, epoch=0)
    ckpt.save(state, step=5)
    committed = ckpt.latest()  # every rank sees the commit once save returns
    draws = [torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()]
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    fresh = Net()
    info = restore_state(ckpt.load_latest(), model=fresh)
    again = [torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()]
    same_params = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    return committed.step, info, draws, again, same_params


def test_per_rank_rng_round_trip_two_ranks(pools, tmp_path):
    results = pools(2).run(_collective_round_trip, str(tmp_path))
    for step, info, draws, again, same_params in results:
        assert step == 5 and same_params
        assert info["rng_restored"] and info["world_size"] == 2
        assert draws == again
    assert results[0][2] != results[1][2]  # each rank got its own stream back


def _failing_save(world, directory):
    ckpt = Checkpointer(directory)
    ckpt.save(small_state(1.0), step=1)
    try:
        ckpt.save({"fn": (lambda: 0) if world.rank == 0 else None}, step=2)
    except CheckpointError as err:
        return str(err), ckpt.latest().step
    return "no error", None


def test_rank0_write_failure_reaches_every_rank(pools, tmp_path):
    results = pools(2).run(_failing_save, str(tmp_path), timeout=60)
    assert "could not write checkpoint" in results[0][0]
    assert "reported by rank 0" in results[1][0]
    assert [r[1] for r in results] == [1, 1]


def test_other_world_size_keeps_data_but_not_rng(pools, tmp_path):
    results = pools(2).run(_save_only, str(tmp_path))
    assert results == [1, 1]
    state = Checkpointer(tmp_path).load_latest()
    assert len(state["rng"]) == 2
    info = restore_state(state, model=Net())
    assert info["world_size"] == 2 and not info["rng_restored"]


def _save_only(world, directory):
    torch.manual_seed(0)
    ckpt = Checkpointer(directory)
    ckpt.save(collect_state(model=Net(), step=1), step=1)
    return ckpt.latest().step



def test_cadence_by_steps_and_by_time(monkeypatch):
    from ddpkit.checkpoint import Cadence

    by_steps = Cadence(every_steps=3)
    assert [s for s in range(10) if by_steps.due(s)] == [3, 6, 9]
    clock = [100.0]
    monkeypatch.setattr("ddpkit.checkpoint.cadence.monotonic", lambda: clock[0])
    by_time = Cadence(every_seconds=60)
    assert not by_time.due(1)
    clock[0] += 61
    assert by_time.due(2)
    by_time.saved()
    assert not by_time.due(3)
    with pytest.raises(CheckpointError, match="every_steps must be >= 1"):
        Cadence(every_steps=0)


class _RunsCode:
    """Unpickled, it would create a file: what a planted pickle could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_metadata_pickle_cannot_run_code(tmp_path):
    """DCP's ``.metadata`` is a pickle: ddpkit's reader builds DCP's own classes and plain
    values, nothing else, so a planted one is refused before it runs anything."""
    import pickle

    from ddpkit.checkpoint import read_model_state

    model = Net()
    path = Checkpointer(tmp_path / "ckpt").save(collect_state(model=model, step=1), 1)
    assert read_model_state(path).keys() == model.state_dict().keys()  # the real one reads
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(pickle.UnpicklingError, match=r"io\.open is not part of a DCP "
                                                     "checkpoint's metadata"):
        read_model_state(path)
    assert not marker.exists()
    # and the verified load skips it as changed since written, never unpickling it
    assert Checkpointer(tmp_path / "ckpt").load_latest() is None
    assert not marker.exists()


@pytest.mark.parametrize("leave", [0, 4096, 8192, 12288, 16384, 20480])
def test_a_full_disk_in_any_dcp_write_is_a_disk_full_error_that_crosses_ranks(tmp_path, leave):
    """Each free space left here fails another write of DCP's: torch's zip writer's short
    write (a RuntimeError, "unexpected pos"), the data file's own write, ``.metadata``.
    Each must be a DiskFullError on the rank that wrote, still one after pickling (DCP
    sends every rank's failure to all), and the save leaves nothing behind."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from chaos_harness import fill, small_filesystem_or_skip
    from ddpkit.checkpoint.dcp_files import hashing_writer
    from ddpkit.files.durable import DiskFullError

    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}}
    with small_filesystem_or_skip(256) as where:
        (where / "raw").mkdir()
        filler = fill(where, leave)
        writer, _ = hashing_writer(where / "raw")
        with pytest.raises(CheckpointException) as caught:
            dcp.save(state, storage_writer=writer, no_dist=True)
        (failure,) = caught.value.failures.values()
        failure = failure[0] if isinstance(failure, tuple) else failure
        assert isinstance(pickle.loads(pickle.dumps(failure)), DiskFullError), repr(failure)
        assert "no space left on device writing in" in str(failure)

        filler.unlink()
        ckpt = Checkpointer(where / "ckpt")
        fill(where, leave)
        with pytest.raises(DiskFullError, match=r"to write .*/ckpt/step_000000001: it needs "):
            ckpt.save(state, 1)
        assert [p.name for p in (where / "ckpt").iterdir()] == []  # no debris


def test_which_failed_writes_are_taken_for_a_full_disk(monkeypatch, tmp_path):
    """ENOSPC anywhere in the chain always; an I/O error of another wording only where
    next to nothing is free; any other error never."""
    import errno

    from ddpkit.files import durable

    enospc = OSError(errno.ENOSPC, "No space left on device")
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
    short_write.__context__ = enospc
    lost_errno = RuntimeError("unexpected pos 704 vs 598")  # as it arrives from another rank
    for free, expected in ((0, True), (10 << 20, False)):
        monkeypatch.setattr(durable, "free_bytes", lambda _, free=free: free)
        assert durable.failed_for_space(short_write, tmp_path)
        assert durable.failed_for_space(enospc, tmp_path)
        assert durable.failed_for_space(lost_errno, tmp_path) is expected
        assert durable.failed_for_space(OSError(errno.EIO, "I/O error"), tmp_path) is expected
        assert not durable.failed_for_space(TypeError("cannot pickle"), tmp_path)


def test_a_planted_non_tensor_value_in_dcp_data_cannot_run_code(tmp_path):
    """DCP pickles the values that are not tensors (an optimizer's hyper-parameters)
    into its data files; ddpkit's load planner reads them with ``weights_only=True``,
    where DCP's own would run what the pickle says."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException

    from ddpkit.checkpoint.dcp_files import SafeLoadPlanner, SafeReader

    marker = tmp_path / "ran"
    dcp.save({"lr": _RunsCode(marker), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"),
             no_dist=True)
    assert not marker.exists()
    with pytest.raises(CheckpointException) as err:
        dcp.load({"lr": 0.0, "w": torch.zeros(2)}, storage_reader=SafeReader(tmp_path / "c"),
                 planner=SafeLoadPlanner(), no_dist=True)
    (failure,) = err.value.failures.values()
    failure = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(failure, pickle.UnpicklingError) and "io.open" in str(failure), failure
    assert not marker.exists()
    # what the test guards against: DCP's default planner runs it
    dcp.load({"lr": 0.0, "w": torch.zeros(2)}, storage_reader=SafeReader(tmp_path / "c"),
             planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.exists()


def _load_where_rank1_sees_an_empty_directory(world, directory):
    """Rank 1 sees ``directory`` as a node without the shared filesystem would: a mount
    namespace of its own lays an empty tmpfs over it (needs root). The namespace is the
    loading thread's alone (a mount namespace is per thread once unshared), so the pool
    worker itself keeps the common view. What each rank raises."""
    import ctypes
    import subprocess
    import threading

    ckpt = Checkpointer(directory)
    ckpt.save(collect_state(model=Net(), step=3), 3)
    out: dict[str, object] = {"hidden": False}

    def load() -> None:
        if world.rank == 1:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(0x00020000) == 0:  # CLONE_NEWNS
                subprocess.run(["mount", "--make-rprivate", "/"], check=True)
                subprocess.run(["mount", "-t", "tmpfs", "tmpfs", directory], check=True)
                out["hidden"] = True
        try:
            ckpt.load_latest()
            out["said"] = "loaded"
        except CheckpointError as err:
            out["said"] = str(err)

    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    return out["hidden"], out["said"]


def test_a_rank_that_cannot_see_the_checkpoint_directory_makes_every_rank_raise(
        pools, tmp_path):
    from chaos_harness import can_mount
    from conftest import skip_unless_required

    if not can_mount():
        skip_unless_required("needs root to give one rank its own view of a directory")
    results = pools(2).run(_load_where_rank1_sees_an_empty_directory, str(tmp_path / "c"))
    if not results[1][0]:
        skip_unless_required("unshare(CLONE_NEWNS) refused")
    (_, said0), (_, said1) = results
    assert said0 != "loaded" and said1 != "loaded"  # every rank raised, none waits
    assert "reported by rank 1" in said0 and "step_000000003" in said1, (said0, said1)
