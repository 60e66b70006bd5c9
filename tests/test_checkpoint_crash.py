"""A writer SIGKILLed at any point of a save leaves the previous checkpoint chosen.

Each child process commits step 1, then starts saving step 2 with one stage of the
write made to stop and announce itself; the parent kills it there with SIGKILL (no
cleanup code runs) and checks what a resuming job would pick.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from ddpkit.checkpoint import Checkpointer

CHILD = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import ddpkit.checkpoint.store as ck

    directory, stage = sys.argv[1], sys.argv[2]
    ckpt = ck.Checkpointer(directory, keep=2)
    ckpt.save({"w": torch.full((8,), 1.0)}, step=1)

    def stop_here():
        print("STOPPED", flush=True)
        time.sleep(120)  # the parent SIGKILLs us now

    if stage == "mid-payload":  # part of the payload is in the temporary file
        # Replaced where Checkpointer._write looks it up: the checkpoint.store module.
        class StoppingWriter(ck._HashingWriter):
            def write(self, data):
                if self.size > 1 << 20:
                    self._f.flush()
                    stop_here()
                return super().write(data)
        ck._HashingWriter = StoppingWriter
    elif stage == "before-rename":  # payload complete and fsynced, not yet renamed
        real_replace = os.replace
        def replace(src, dst):
            stop_here()
        os.replace = replace
    elif stage == "before-manifest":  # payload renamed into place, no manifest yet
        ck.Checkpointer._write_small = lambda self, path, data: stop_here()
    ckpt.save({f"w{i}": torch.full((1 << 20,), 2.0) for i in range(4)}, step=2)  # 16 MiB
    print("NOT STOPPED", flush=True)
    """
)

STAGES = ("mid-payload", "before-rename", "before-manifest")


def _start(tmp_path, stage):
    directory = tmp_path / stage
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), stage],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return directory, proc


def test_killed_writer_leaves_previous_checkpoint_chosen(tmp_path):
    # All stages run at once: each child pays the torch import, in parallel.
    children = {stage: _start(tmp_path, stage) for stage in STAGES}
    # Control: with no stage stopped, the same harness saves step 2 normally.
    control_dir, control = _start(tmp_path, "none")
    try:
        out, err = control.communicate(timeout=120)
        assert control.returncode == 0 and out.strip() == "NOT STOPPED", err
        assert [i.step for i in Checkpointer(control_dir).checkpoints()] == [1, 2]
        for stage, (_, proc) in children.items():
            line = proc.stdout.readline().strip()
            assert line == "STOPPED", f"{stage}: child said {line!r}: {proc.stderr.read()}"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.returncode == -signal.SIGKILL
    finally:
        for _, proc in [*children.values(), (control_dir, control)]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    for stage, (directory, _) in children.items():
        leftovers = sorted(os.listdir(directory))
        # The kill really happened mid-save: step 2 left something behind.
        if stage == "before-manifest":
            assert "step_000000002.pt" in leftovers and "step_000000002.json" not in leftovers
        else:
            assert any(n.startswith(".step_000000002.pt.tmp-") for n in leftovers), leftovers
            if stage == "mid-payload":
                tmp = next(n for n in leftovers if n.startswith(".step_000000002"))
                complete = Checkpointer(control_dir).path_for(2).stat().st_size
                assert 0 < os.path.getsize(directory / tmp) < complete
        ckpt = Checkpointer(directory, keep=2)
        assert ckpt.latest().step == 1, stage
        state = ckpt.load_latest()
        assert torch.equal(state["w"], torch.full((8,), 1.0)), stage

        # The next save cleans the debris and becomes the latest.
        ckpt.save({"w": torch.full((8,), 3.0)}, step=3)
        assert sorted(os.listdir(directory)) == [
            "step_000000001.json", "step_000000001.pt", "step_000000003.json", "step_000000003.pt"
        ], stage
        assert ckpt.latest().step == 3

