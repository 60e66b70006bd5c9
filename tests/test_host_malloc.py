"""Which allocator settings the launcher gives its workers."""

import os
import subprocess
import sys

from conftest import ROOT
from ddpkit.host_malloc import KEEP_LARGE_BLOCKS, worker_malloc_env


def test_workers_keep_large_blocks_unless_the_user_decides():
    assert worker_malloc_env({}) == KEEP_LARGE_BLOCKS
    assert worker_malloc_env({"DDPKIT_SYSTEM_MALLOC": "1"}) == {}
    assert worker_malloc_env({"MALLOC_ARENA_MAX": "2"}) == {}  # the user's malloc settings
    assert worker_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == {}


PRINTS_ITS_MALLOC_ENV = """
import os
print("seen", sorted((k, v) for k, v in os.environ.items() if k.startswith("MALLOC_")))
"""


def test_a_launched_worker_gets_them(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(PRINTS_ITS_MALLOC_ENV)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "DDPKIT_SYSTEM_MALLOC")}
    proc = subprocess.run([sys.executable, "-m", "ddpkit.cli", "launch", "--nproc-per-node",
                           "1", str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"seen {sorted(KEEP_LARGE_BLOCKS.items())}" in proc.stdout, proc.stdout[-2000:]


FAULTS_OF_A_FRESH_BLOCK = """
import os, resource, sys, tempfile
import torch, torch.distributed as dist
import ddpkit

def faults_of_a_fresh_64_mib_tensor():
    torch.empty(1 << 24).fill_(1.0)  # allocated, touched and freed once before
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(1 << 24).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
print("before", faults_of_a_fresh_64_mib_tensor())
model = ddpkit.DataParallel(torch.nn.Linear(4, 4))
print("after", faults_of_a_fresh_64_mib_tensor())
dist.destroy_process_group()
"""


def _faults_around_wrapping(env_extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "DDPKIT_SYSTEM_MALLOC")}
    proc = subprocess.run([sys.executable, "-c", FAULTS_OF_A_FRESH_BLOCK], cwd=ROOT,
                          env={**env, **env_extra}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict((k, int(v)) for k, v in (line.split() for line in proc.stdout.splitlines()))


def test_a_process_not_started_by_the_launcher_gets_them_from_data_parallel():
    """A script run by plain torchrun: wrapping a CPU model applies the settings in place,
    so a freed 64 MiB block is reused instead of faulting its 16384 pages in again."""
    pages = (1 << 26) // os.sysconf("SC_PAGE_SIZE")
    faults = _faults_around_wrapping({})
    assert faults["before"] > pages // 2, faults  # glibc's default: a fresh mapping
    assert faults["after"] < pages // 20, faults
    kept = _faults_around_wrapping({"DDPKIT_SYSTEM_MALLOC": "1"})
    assert kept["after"] > pages // 2, kept  # opted out: glibc's defaults stay
