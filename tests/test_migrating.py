"""docs/migrating.md is true: its code is the examples' code, and each example trains
exactly like the program it replaces.

* torch DDP + torchrun (60): the example under ``ddpkit launch`` and the example with
  torch's import put back under ``torchrun``, run with the doc's two command lines;
* mp.spawn (61): the doc's mp.spawn program, the example under ``python`` and under
  ``ddpkit launch``;
* Accelerate style (62): the example on 2 processes (``ddpkit launch``) and on 1 (``python``)
  at the same global batch.

Final parameters are compared with torch.equal (62: float32 rounding, < 1e-6).

The plain torch programs are references, run with ddpkit's exit teardown loaded at
start-up (tests/torch_reference/sitecustomize.py): torch alone can abort at interpreter
exit after succeeding, a defect of torch's that must not fail these comparisons.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import ROOT

DOC = Path(ROOT, "docs", "migrating.md")
PY = sys.executable
TIMEOUT_S = 180
# A tagged block: <!-- kind: target -->, then a fenced block.
BLOCK = re.compile(r"<!-- ([\w ]+): ([^>]+?) -->\n```(\w+)\n(.*?)\n```", re.S)
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def doc_blocks(kind: str, target: str | None = None) -> list[str]:
    return [body for k, t, _, body in BLOCK.findall(DOC.read_text())
            if k == kind and (target is None or t == target)]


def diff_lines(body: str) -> tuple[list[str], list[str]]:
    lines = body.splitlines()
    return [x[1:] for x in lines if x[:1] == "-"], [x[1:] for x in lines if x[:1] == "+"]


def example(name: str) -> Path:
    return Path(ROOT, "examples", name)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's variables: every run starts the same way."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("PET_", "TORCHELASTIC_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


TORCH_REFERENCE = {"PYTHONPATH": os.path.join(ROOT, "tests", "torch_reference")}


def run(argv: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=ROOT, env=clean_env(**extra_env), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc


def run_side_by_side(*runs: tuple[list[str], dict[str, str]]) -> list[subprocess.CompletedProcess]:
    """``run(argv, **env)`` for each of several independent programs, all at once: most
    of a launch is processes importing torch and waiting on each other, so two cores
    finish them sooner together than one after the other."""
    with ThreadPoolExecutor(len(runs)) as pool:
        done = [pool.submit(run, argv, **env) for argv, env in runs]
    return [d.result() for d in done]


def assert_equal_states(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    diff = max((x.double() - b[k].double()).abs().max().item() for k, x in a.items())
    assert all(torch.equal(x, b[k]) for k, x in a.items()), f"{what}: max difference {diff}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the page is the code
def test_every_snippet_of_the_page_is_in_its_example():
    snippets = BLOCK.findall(DOC.read_text())
    named = {t for k, t, _, _ in snippets if k in ("snippet", "diff", "commands")}
    assert {f"examples/{n}" for n in ("60_from_torch_ddp.py", "61_from_mp_spawn.py",
                                      "62_from_accelerate_style.py")} <= named
    for kind, target, _, body in snippets:
        if kind == "snippet":
            lines = Path(ROOT, target).read_text().splitlines()
            want = textwrap.dedent(body).splitlines()
            windows = (textwrap.dedent("\n".join(lines[i:i + len(want)])).splitlines()
                       for i in range(len(lines) - len(want) + 1))
            assert want in windows, f"docs/migrating.md shows code that is not in {target}:\n{body}"
        elif kind == "diff":
            removed, added = diff_lines(body)
            lines = Path(ROOT, target).read_text().splitlines()
            assert removed and added and all(a in lines for a in added), body
            assert not any(r in lines for r in removed), body
        elif kind == "commands":
            (torchrun,), (ddpkit,) = diff_lines(body)
            assert torchrun.startswith("torchrun ") and ddpkit.startswith("ddpkit launch ")
            # the same flags, the same script, the same arguments
            assert torchrun.removeprefix("torchrun ") == ddpkit.removeprefix("ddpkit launch ")
            assert target in ddpkit.split()
        else:
            assert kind in ("before", "not run"), f"unknown block kind {kind!r}"


# ---------------------------------------------------------------- 60: torch DDP + torchrun
def test_torch_ddp_script_with_one_import_changed_trains_as_under_torchrun(tmp_path):
    ours = example("60_from_torch_ddp.py")
    target = str(ours.relative_to(ROOT))
    (torch_import,), (ddpkit_import,) = diff_lines(doc_blocks("diff", target)[0])
    source = ours.read_text()
    assert source.count(ddpkit_import + "\n") == 1
    theirs = tmp_path / "60_from_torch_ddp.py"  # the user's torch program: the import put back
    theirs.write_text(source.replace(ddpkit_import + "\n", torch_import + "\n"))

    (torchrun_line,), (launch_line,) = diff_lines(doc_blocks("commands", target)[0])
    runs = {}
    for who, line, launcher, script, env in (
            ("torchrun", torchrun_line, [PY, "-m", "torch.distributed.run"], theirs,
             TORCH_REFERENCE),
            ("ddpkit", launch_line, [PY, "-m", "ddpkit.cli", "launch"], ours, {})):
        words = shlex.split(line)[2 if who == "ddpkit" else 1:]
        words = [str(script) if w == target else w for w in words]
        words[words.index("model.pt")] = str(tmp_path / f"{who}.pt")
        runs[who] = ([*launcher, *words], env)
    procs = dict(zip(runs, run_side_by_side(*runs.values()), strict=True))
    outputs = {who: re.findall(r"epoch \d+: mean loss \S+", proc.stdout)
               for who, proc in procs.items()}
    saved = {who: torch.load(tmp_path / f"{who}.pt") for who in runs}
    assert len(outputs["ddpkit"]) == 3 and outputs["ddpkit"] == outputs["torchrun"], outputs
    assert_equal_states(saved["torchrun"], saved["ddpkit"], "torch DDP under torchrun vs ddpkit")


# ---------------------------------------------------------------- 61: mp.spawn
def test_mp_spawn_program_and_its_ddpkit_version_train_the_same_under_spawn_and_launch(tmp_path):
    (before,) = doc_blocks("before", "mp.spawn")
    assert before.count('"12355"') == 1
    original = tmp_path / "mp_spawn_original.py"
    original.write_text(before.replace('"12355"', f'"{free_port()}"'))
    ours = str(example("61_from_mp_spawn.py"))
    one_thread = {"OMP_NUM_THREADS": "1"}  # what torchrun sets; kernels round per thread count
    _, spawned, launched = run_side_by_side(
        ([PY, str(original), str(tmp_path / "mp_spawn.pt")], {**one_thread, **TORCH_REFERENCE}),
        ([PY, ours, str(tmp_path / "ddpkit_spawn.pt")], one_thread),
        ([PY, "-m", "ddpkit.cli", "launch", "--nproc-per-node", "2", ours,
          str(tmp_path / "ddpkit_launch.pt")], {}))
    assert "last loss per rank: [" in spawned.stdout
    assert re.search(r"\[default1\]:rank 1: last loss", launched.stdout), launched.stdout
    reference = torch.load(tmp_path / "mp_spawn.pt")
    assert_equal_states(reference, torch.load(tmp_path / "ddpkit_spawn.pt"), "ddpkit.spawn")
    assert_equal_states(reference, torch.load(tmp_path / "ddpkit_launch.pt"), "ddpkit launch")


# ---------------------------------------------------------------- 62: Accelerate style
def test_accelerate_style_script_on_two_processes_equals_one_and_gathers_metrics(tmp_path):
    script = str(example("62_from_accelerate_style.py"))
    # Two processes under the launcher; one is the script run as it is, with python.
    launchers = {2: [PY, "-m", "ddpkit.cli", "launch", "--nproc-per-node", "2"], 1: [PY]}
    procs = run_side_by_side(*(
        ([*launcher, script, "--save", str(tmp_path / f"w{nproc}.pt")], {})
        for nproc, launcher in launchers.items()))
    for proc in procs:
        assert proc.stdout.count("on 101 samples") == 3, proc.stdout  # no padding counted
    out = {nproc: torch.load(tmp_path / f"w{nproc}.pt") for nproc in launchers}
    two, one = out[2], out[1]
    assert list(two["model"]) == list(one["model"])
    diff = max((two["model"][k] - one["model"][k]).abs().max().item() for k in one["model"])
    assert diff < 1e-6, f"2 processes vs 1 at the same global batch: {diff}"
    sys.path.insert(0, str(Path(ROOT, "examples")))
    try:
        labels = __import__("62_from_accelerate_style").make_data(101, seed=1).tensors[1]
    finally:
        sys.path.remove(str(Path(ROOT, "examples")))
    assert torch.equal(two["references"], labels), "gathered labels are not in dataset order"
    assert torch.equal(two["predictions"], one["predictions"])
    assert (one["predictions"] == labels).float().mean() > 0.5  # it learned something


@pytest.mark.parametrize("name", ["60_from_torch_ddp.py", "61_from_mp_spawn.py",
                                  "62_from_accelerate_style.py"])
def test_examples_say_how_to_run_them(name):
    doc = example(name).read_text().split('"""')[1]
    assert f"ddpkit launch --nproc-per-node 2 examples/{name}" in doc.replace(
        "--standalone ", "")


DEVICE_IDS_ON_CPU = """
import os
import torch.distributed as dist
from torch import nn
from ddpkit import DataParallel as DDP
dist.init_process_group("gloo")
DDP(nn.Linear(4, 2), device_ids=[int(os.environ["LOCAL_RANK"])])
"""


def torch_ddp_device_ids_on_cpu(world) -> str:
    """What torch's DistributedDataParallel raises for the script's call, on this rank."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    try:
        DistributedDataParallel(nn.Linear(4, 2), device_ids=[world.local_rank])
    except Exception as exc:  # its type and message are what is compared
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_device_ids_on_a_cpu_module_is_one_line_per_rank_and_exit_2(tmp_path, pools):
    """What docs/migrating.md says a refused argument looks like in your own script under
    `ddpkit launch`: one line per rank saying what to do, no traceback, exit 2, where
    torch DDP raises a ValueError for the same call (checked on the pooled ranks)."""
    script = tmp_path / "cpu_device_ids.py"
    script.write_text(DEVICE_IDS_ON_CPU)
    for raised in pools(2).run(torch_ddp_device_ids_on_cpu):
        assert raised.startswith("ValueError: DistributedDataParallel device_ids"), raised
    ours = subprocess.run(
        [PY, "-m", "ddpkit.cli", "launch", "--nproc-per-node", "2", str(script)], cwd=ROOT,
        env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert ours.returncode == 2, ours.stderr[-3000:]
    assert "Traceback" not in ours.stderr, ours.stderr[-3000:]
    for rank in (0, 1):
        line = (f"[default{rank}]:[rank{rank}]: ddpkit: error: "
                f"device_ids=[{rank}] but the module is on cpu; move the module there first "
                "(model.to(device)), or pass device_ids=None")
        rank_lines = [x for x in ours.stderr.splitlines() if x.startswith(f"[default{rank}]:")]
        assert rank_lines == [line], ours.stderr[-3000:]
    assert ours.stderr.strip().splitlines()[-1].startswith("ddpkit launch: rank "), ours.stderr
    assert "device_ids=[0] but the module is on cpu; move the module there first" in DOC.read_text(
        ).replace("\n", " ")
