"""A writer SIGKILLed at any point of a save leaves the previous checkpoint chosen.

Each child process commits step 1, then starts saving step 2 with one stage of the
write (DCP's data file half written; DCP's save complete, ``.metadata`` included;
everything written but the directory not yet renamed) made to stop and announce
itself; the parent kills it there with SIGKILL (no cleanup code runs) and checks what
a resuming job would pick.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from ddpkit.checkpoint import Checkpointer, collect_state, restore_state

CHILD = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import ddpkit.checkpoint.dcp_files as files
    import ddpkit.checkpoint.step_write as step_write
    from ddpkit.checkpoint import Checkpointer, collect_state

    class Net(torch.nn.Module):
        def __init__(self, value, n):
            super().__init__()
            self.w = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.full((n,), value)) for _ in range(4)])

    directory, stage = sys.argv[1], sys.argv[2]
    ckpt = Checkpointer(directory, keep=2)
    ckpt.save(collect_state(model=Net(1.0, 8), step=1), step=1)

    def stop_here(*args, **kwargs):
        print("STOPPED", flush=True)
        time.sleep(120)  # the parent SIGKILLs us now

    if stage == "mid-dcp-data":  # part of DCP's data file is written
        class StoppingStream(files._HashingStream):
            def write(self, data):
                if self.size > 1 << 20:
                    self._f.flush()
                    stop_here()
                return super().write(data)
        files._HashingStream = StoppingStream
    elif stage == "after-dcp-metadata":  # DCP's save is complete, .metadata and all
        step_write.atomic_file = stop_here
    elif stage == "before-commit":  # every file and the manifest written, not renamed
        Checkpointer._commit = stop_here
    ckpt.save(collect_state(model=Net(2.0, 1 << 20), step=2), step=2)  # 16 MiB
    print("NOT STOPPED", flush=True)
    """
)

STAGES = ("mid-dcp-data", "after-dcp-metadata", "before-commit")


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
        # The kill really happened mid-save: step 2 left a hidden directory behind.
        debris = [n for n in leftovers if n.startswith(".step_000000002.tmp-")]
        assert len(debris) == 1 and "step_000000002" not in leftovers, (stage, leftovers)
        inside = sorted(os.listdir(directory / debris[0]))
        if stage == "mid-dcp-data":
            data = directory / debris[0] / "__0_0.distcp"
            complete = (Checkpointer(control_dir).path_for(2) / "__0_0.distcp").stat().st_size
            assert 0 < data.stat().st_size < complete and ".metadata" not in inside
        else:  # DCP alone would take this directory for whole: ddpkit never does
            assert ".metadata" in inside, inside
            assert ("manifest.json" in inside) == (stage == "before-commit"), inside
        ckpt = Checkpointer(directory, keep=2)
        assert ckpt.latest().step == 1, stage
        holder = Holder()
        restore_state(ckpt.load_latest(), model=holder)
        assert all(torch.equal(w, torch.full((8,), 1.0)) for w in holder.w), stage

        # The next save cleans the debris and becomes the latest.
        ckpt.save(collect_state(model=Holder(3.0), step=3), step=3)
        assert sorted(os.listdir(directory)) == ["step_000000001", "step_000000003"], stage
        assert ckpt.latest().step == 3


class Holder(torch.nn.Module):
    def __init__(self, value: float = 0.0):
        super().__init__()
        self.w = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.full((8,), value)) for _ in range(4)])
