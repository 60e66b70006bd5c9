"""Each kind of damage to the newest checkpoint is named in words that say what is wrong,
the checkpoint is never used, and the newest one that verifies is; with every one
damaged, each warning says truthfully what is left to fall back to."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from chaos_harness import DAMAGES, damage_everything, words_for
from ddpkit.checkpoint import Checkpointer, collect_state, restore_state


@pytest.fixture
def warnings_seen(caplog):
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        yield caplog


class Holder(torch.nn.Module):
    def __init__(self, value: float = 0.0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((64,), value))


def _three(tmp_path) -> Checkpointer:
    ckpt = Checkpointer(tmp_path / "ck", keep=None)
    for step in (10, 20, 30):
        ckpt.save(collect_state(model=Holder(float(step)), step=step), step=step)
    return ckpt


def _w(state) -> torch.Tensor:
    holder = Holder()
    restore_state(state, model=holder)
    return holder.w.detach()


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.name for d in DAMAGES])
def test_damaged_newest_checkpoint_is_named_and_never_used(tmp_path, warnings_seen, damage):
    ckpt = _three(tmp_path)
    damage.apply(ckpt.dir, 30, 20)
    expected = 30 if not damage.falls_back else 20
    assert ckpt.latest().step == expected
    state = ckpt.load_latest()
    assert torch.equal(_w(state), torch.full((64,), float(expected)))
    lines = [r.getMessage() for r in warnings_seen.records]
    if not damage.falls_back:
        assert not [line for line in lines if "skipping" in line], lines
        return
    pattern = words_for(damage, ckpt.dir, 30, 20)
    named = [line for line in lines if re.search(pattern, line)]
    assert named, (pattern, lines)
    assert all(line.endswith("falling back to step_000000020 (step 20)") for line in named)


def test_every_checkpoint_damaged_says_what_is_left_at_each_one(tmp_path, warnings_seen):
    ckpt = _three(tmp_path)
    damage_everything(ckpt.dir)
    assert ckpt.latest() is None and ckpt.load_latest() is None
    lines = [r.getMessage() for r in warnings_seen.records if "skipping" in r.getMessage()]
    endings = [line.rsplit("; ", 1)[1] for line in lines[:3]]
    assert endings == ["the 2 older ones are damaged too", "the 1 older one is damaged too",
                       "no older checkpoint to fall back to"], lines
    assert all("truncated: 7 bytes, its manifest says" in line for line in lines[:3])


def test_leftovers_of_damage_are_cleared_by_the_next_save(tmp_path):
    ckpt = Checkpointer(tmp_path / "ck", keep=None)
    for step in (10, 20, 30):
        ckpt.save({"step": step}, step=step)
    (ckpt.dir / "step_000000020" / "run.pt").unlink()  # a manifest left without its file
    (ckpt.dir / "step_000000030" / "manifest.json").write_text("{")  # an unreadable manifest
    (ckpt.dir / ".step_000000035.tmp-99999").mkdir()  # a writer that died
    ckpt.save({"step": 40}, step=40)
    names = sorted(p.name for p in ckpt.dir.iterdir())
    assert names == ["step_000000010", "step_000000040"]


def test_the_launchers_look_at_a_stopped_run_reads_manifests_without_importing_dcp(tmp_path):
    """`ddpkit train`'s launcher asks, after its workers ended, whether a stop signal
    wrote the newest checkpoint: the manifests say so, and torch's DCP (most of a second
    to import, in every launch) stays out of that process."""
    import subprocess
    import sys

    Checkpointer(tmp_path / "checkpoints", keep=None).save(
        collect_state(model=Holder(1.0), step=4), step=4, reason="preempted")
    probe = ("import sys; from pathlib import Path; from ddpkit.train import resume; "
             f"found = resume.preempted_since(Path({str(tmp_path)!r}), 0.0); "
             "print(found.step, 'torch.distributed.checkpoint' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["4", "False"], proc.stdout
