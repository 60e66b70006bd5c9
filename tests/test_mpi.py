"""Programs started by OpenMPI's mpirun: World from OMPI_* variables, gloo underneath.

`mpirun` only starts the processes and tells each its place; the process group is still
torch's gloo over MASTER_ADDR/MASTER_PORT (exported with `-x`). CI installs OpenMPI
(`apt-get install -y openmpi-bin`); without it the real-mpirun test skips and the
simulated-environment test still checks the parsing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, skip_unless_required
from test_multinode import (
    DDPKIT,
    NODE_TIMEOUT_S,
    TRAIN_ARGS,
    assert_same_training,
    child_env,
    reference_run,
    world_lines,
)
from test_slurm import free_port

EXAMPLE = str(Path(ROOT) / "examples" / "40_mpi_train.py")


@pytest.mark.slow
def test_world_from_simulated_openmpi_variables():
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, EXAMPLE, "--steps", "0"], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=child_env(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                                       OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                                       OMPI_COMM_WORLD_LOCAL_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for r in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=NODE_TIMEOUT_S)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    worlds = [world_lines(out) for out in outputs]
    assert worlds == [[dict(rank=r, local_rank=r, world_size=2, local_world_size=2, node_rank=0,
                            nnodes=1, source="openmpi")] for r in (0, 1)]


@pytest.mark.slow
def test_mpirun_train_equals_one_node_run(tmp_path, train_reference):
    if shutil.which("mpirun") is None:
        skip_unless_required("OpenMPI's mpirun is not installed (apt-get install -y openmpi-bin)")
    want = reference_run(train_reference)
    out = tmp_path / "runs"
    cmd = ["mpirun", "-n", "2", "--allow-run-as-root", "--oversubscribe",
           "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}",
           "-x", "OMP_NUM_THREADS=1",
           *DDPKIT, "train", *TRAIN_ARGS, "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=NODE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s) x 64 = global batch 128" in proc.stdout + proc.stderr
    assert_same_training(out, want)
