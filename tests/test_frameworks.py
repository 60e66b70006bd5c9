"""Hugging Face Accelerate, the transformers Trainer and Lightning, unchanged, on ddpkit's
engine and collectives (docs/frameworks.md), with the real packages at 2 ranks on CPU.

Each program of tests/framework_programs runs under ``ddpkit launch`` (and Lightning's
also under its own spawning, with ``DDPKIT_ENGINE=ddpkit``) and under ``torchrun`` with
torch's own DDP: the trained parameters are equal bit for bit, the framework's own saving
gives a state dict that loads into the plain model, every process exits 0, and a rank
that raises inside the framework is named in ``ddpkit launch``'s one-line summary below
its single traceback. One launch serves every test that checks it (a launch is mostly
processes importing torch and a framework).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "framework_programs"
PY = sys.executable
LAUNCHERS = {
    "ddpkit": [PY, "-m", "ddpkit.cli", "launch", "--nproc-per-node", "2"],
    "torch": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "own": [PY],  # Lightning starts its second rank itself
}
TIMEOUT_S = 300


def _env(launcher: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DDPKIT_", "PET_", "TORCHELASTIC_")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(home / "hf"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if launcher == "own":
        env["DDPKIT_ENGINE"] = "ddpkit"
    return env


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, out: Path):
        self.proc, self.out = proc, out
        self.ranks = [json.loads((out / f"rank{r}.json").read_text())
                      for r in range(2) if (out / f"rank{r}.json").exists()]

    def ok(self) -> Run:
        assert self.proc.returncode == 0, self.proc.stderr[-4000:]
        assert len(self.ranks) == 2, self.proc.stderr[-4000:]
        return self


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches(program, launcher, *args)``: the run, launched once per module."""
    done: dict[tuple, Run] = {}
    base = tmp_path_factory.mktemp("frameworks")

    def get(program: str, launcher: str, *args: str) -> Run:
        key = (program, launcher, args)
        if key not in done:
            out = base / f"{program}-{launcher}-{len(done)}"
            out.mkdir()
            proc = subprocess.run(
                [*LAUNCHERS[launcher], str(PROGRAMS / f"{program}_program.py"), "--out",
                 str(out), *args], cwd=out, env=_env(launcher, base), capture_output=True,
                text=True, timeout=TIMEOUT_S)
            done[key] = Run(proc, out)
        return done[key]

    return get


def _program(name: str):
    """A framework program imported as a module (for its plain model)."""
    sys.path.insert(0, str(PROGRAMS))
    try:
        spec = importlib.util.spec_from_file_location(name, PROGRAMS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(PROGRAMS))
    return module


def assert_engines(ours: Run, theirs: Run) -> None:
    for rank in range(2):
        assert ours.ranks[rank]["engine"] == {
            "class": "ddpkit.parallel.compat.torch_swap.DistributedDataParallel",
            "is_torch_ddp": True, "is_ddpkit": True}, ours.ranks[rank]
        assert theirs.ranks[rank]["engine"]["is_ddpkit"] is False, theirs.ranks[rank]
        assert theirs.ranks[rank]["routed"] == {}, theirs.ranks[rank]


def assert_same_tensors(ours: dict, theirs: dict, what: str) -> None:
    assert list(ours) == list(theirs), what
    different = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    assert not different, f"{what}: {different} differ from torch DDP's"


def test_accelerate_script_trains_as_under_torch_ddp(launches):
    ours, theirs = launches("accelerate", "ddpkit").ok(), launches("accelerate", "torch").ok()
    assert_engines(ours, theirs)
    for rank in range(2):
        # accelerator.reduce and wait_for_everyone: torch.distributed's calls, ddpkit's answers
        routed = ours.ranks[rank]["routed"]
        assert routed["all_reduce"] == len(ours.ranks[rank]["losses"]) and routed["barrier"]
        assert ours.ranks[rank]["losses"] == theirs.ranks[rank]["losses"]
    saved = torch.load(ours.out / "model.pt")
    plain = _program("framework_record").mlp()
    plain.load_state_dict(saved)  # accelerator.unwrap_model(model).state_dict()
    assert_same_tensors(saved, torch.load(theirs.out / "model.pt"), "Accelerate")


def test_transformers_trainer_trains_as_under_torch_ddp(launches):
    from safetensors.torch import load_file
    from transformers import BertForSequenceClassification

    ours, theirs = launches("trainer", "ddpkit").ok(), launches("trainer", "torch").ok()
    assert_engines(ours, theirs)
    for rank in range(2):
        assert ours.ranks[rank]["unwrapped_is_model"], "accelerator.unwrap_model"
        assert ours.ranks[rank]["losses"] == theirs.ranks[rank]["losses"]
        assert ours.ranks[rank]["train_loss"] == theirs.ranks[rank]["train_loss"]
        # the Trainer gathers the batch's token count every step: ddpkit answers it
        assert ours.ranks[rank]["routed"].get("all_gather", 0) >= len(
            ours.ranks[rank]["losses"]), ours.ranks[rank]["routed"]
    plain = BertForSequenceClassification.from_pretrained(ours.out / "model")
    assert_same_tensors(plain.state_dict(), BertForSequenceClassification.from_pretrained(
        theirs.out / "model").state_dict(), "Trainer")
    assert_same_tensors(load_file(ours.out / "model" / "model.safetensors"),
                        load_file(theirs.out / "model" / "model.safetensors"),
                        "trainer.save_model")


@pytest.mark.parametrize("launcher", ["ddpkit", "own"])
def test_lightning_trains_as_under_torch_ddp(launches, launcher):
    """Under ``ddpkit launch``, and started as ``python program.py`` with
    ``DDPKIT_ENGINE=ddpkit`` (Lightning starts rank 1 itself, which inherits it)."""
    ours, theirs = launches("lightning", launcher).ok(), launches("lightning", "torch").ok()
    assert_engines(ours, theirs)
    for rank in range(2):
        # self.log(..., sync_dist=True): a barrier and an all_reduce per logged step
        routed = ours.ranks[rank]["routed"]
        assert routed["all_reduce"] >= len(ours.ranks[rank]["step_s"]), routed
        assert routed["barrier"] >= routed["all_reduce"], routed
        assert ours.ranks[rank]["after_fit_is_module"], "the strategy unwraps the model"
        assert (ours.ranks[rank]["train_loss_epoch"]
                == theirs.ranks[rank]["train_loss_epoch"])
    checkpoint = torch.load(ours.out / "model.ckpt", weights_only=False)
    plain = _program("lightning_program").Classifier()
    plain.load_state_dict(checkpoint["state_dict"])
    assert_same_tensors(checkpoint["state_dict"],
                        torch.load(theirs.out / "model.ckpt", weights_only=False)["state_dict"],
                        f"Lightning ({launcher})")


@pytest.mark.parametrize("program, message", [
    ("accelerate", "RuntimeError: forward failed on purpose"),
    ("trainer", "RuntimeError: a callback failed on purpose"),
    ("lightning", "RuntimeError: training_step failed on purpose"),
])
def test_a_rank_that_raises_inside_the_framework_is_named(launches, program, message):
    run = launches(program, "ddpkit", "--fail-rank", "1")
    both = run.proc.stdout + run.proc.stderr
    assert run.proc.returncode == 1, both[-3000:]
    assert both.count(message) == 1, both[-3000:]
    assert f"[default1]:[rank1]: {message}" in both, both[-3000:]
    summary = run.proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("ddpkit launch: rank 1 failed first (exit code 1"), summary


PROBE = """
import sys
started_with = sorted(m for m in ("torch", "ddpkit") if m in sys.modules)
import torch
import torch.distributed as dist
print(started_with, torch.nn.parallel.DistributedDataParallel.__module__,
      dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"
      and dist.all_reduce.__code__.co_filename.endswith("torch_route.py"))
"""


@pytest.mark.parametrize("value, expected", [
    (None, "[] torch.nn.parallel.distributed False"),
    ("torch", "[] torch.nn.parallel.distributed False"),
    ("ddpkit", "['ddpkit', 'torch'] ddpkit.parallel.compat.torch_swap True"),
])
def test_the_engine_variable_swaps_before_the_program_and_costs_nothing_unset(
        tmp_path, value, expected):
    """``ddpkit-engine.pth`` (installed with ddpkit, editable installs included): unset,
    an interpreter starts without importing ddpkit or torch; ``ddpkit`` swaps before the
    program's first line."""
    env = _env("ddpkit", tmp_path)
    if value is not None:
        env["DDPKIT_ENGINE"] = value
    proc = subprocess.run([PY, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == expected, proc.stdout + proc.stderr


def test_a_bad_engine_variable_is_one_line(tmp_path):
    env = {**_env("ddpkit", tmp_path), "DDPKIT_ENGINE": "fast"}
    proc = subprocess.run([PY, "-c", "print('ran')"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout == "ran\n", proc.stdout
    assert proc.stderr.splitlines() == [
        "ddpkit: error: DDPKIT_ENGINE='fast' is not one of ddpkit, torch (ddpkit: torch's "
        "DistributedDataParallel and CPU collectives are ddpkit's; torch: torch's own)"]
    launch = subprocess.run([*LAUNCHERS["ddpkit"], "x.py"], env=env, capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert launch.returncode == 2
    assert launch.stderr.splitlines()[-1] == proc.stderr.strip().replace(
        "ddpkit: error:", "ddpkit launch: error:"), launch.stderr
    del env["DDPKIT_ENGINE"]
    launch = subprocess.run([*LAUNCHERS["ddpkit"], "--engine", "fast", "x.py"], env=env,
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert launch.returncode == 2
    assert launch.stderr.splitlines() == [
        "ddpkit launch: error: argument --engine: invalid choice: 'fast' (choose from "
        "'ddpkit', 'torch')"], launch.stderr


def test_launch_engine_torch_keeps_torchs_class_and_collectives(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      + PROBE.replace("print(", "print(dist.get_rank(), "))
    proc = subprocess.run([*LAUNCHERS["ddpkit"], "--engine", "torch", str(script)],
                          env=_env("ddpkit", tmp_path), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"[default{rank}]:{rank} " in proc.stdout, proc.stdout
        assert "torch.nn.parallel.distributed False" in proc.stdout, proc.stdout
    assert "ddpkit.parallel.compat.torch_swap" not in proc.stdout, proc.stdout
