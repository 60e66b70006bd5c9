"""``ddpkit env`` and ``ddpkit --version``."""

import os
import subprocess
import sys
from importlib.metadata import version


def _ddpkit(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "ddpkit.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_version_prints_installed_version():
    out = _ddpkit("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ddpkit {version('ddpkit')}"


def test_env_reports_versions_backends_and_distributed_variables():
    import torch

    out = _ddpkit("env", env_extra={"WORLD_SIZE": "4", "SLURM_JOB_ID": "1234",
                                    "TORCHELASTIC_RUN_ID": "abc", "UNRELATED_VAR": "x"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert torch.__version__ in text
    from ddpkit.runtime.torch_target import (
        TORCH_CHECKED,  # the release the workarounds were checked on
    )
    assert any(line.split() == ["torch", "checked", TORCH_CHECKED] for line in text.splitlines())
    assert sys.version.split()[0] in text
    for key in ("backend gloo", "backend nccl", "backend mpi", "backend ucc", "cpu cores",
                "memory", "/dev/shm", "cuda available", "nccl version"):
        assert key in text, key
    gloo = "yes" if torch.distributed.is_gloo_available() else "no"
    assert any(line.split() == ["backend", "gloo", gloo] for line in text.splitlines())
    assert "  WORLD_SIZE=4" in text and "  SLURM_JOB_ID=1234" in text
    assert "TORCHELASTIC_RUN_ID=abc" in text
    assert "UNRELATED_VAR" not in text and "DDPKIT_CLI_LOGGING" not in text
