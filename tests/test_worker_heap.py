"""Which allocator settings the launcher gives its workers."""

import os
import subprocess
import sys

from conftest import ROOT
from ddpkit.launcher.worker_heap import KEEP_LARGE_BLOCKS, worker_malloc_env


def test_workers_keep_large_blocks_unless_the_user_decides():
    assert worker_malloc_env({}) == KEEP_LARGE_BLOCKS
    assert worker_malloc_env({"DDPKIT_SYSTEM_MALLOC": "1"}) == {}
    assert worker_malloc_env({"MALLOC_ARENA_MAX": "2"}) == {}  # the user's malloc settings
    assert worker_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == {}


def _undecided_environment() -> dict[str, str]:
    """This environment without anything that decides the heap settings."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "DDPKIT_SYSTEM_MALLOC")}


PRINTS_ITS_MALLOC_ENV = """
import os
print("seen", sorted((k, v) for k, v in os.environ.items() if k.startswith("MALLOC_")))
"""


def test_a_launched_worker_gets_them(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(PRINTS_ITS_MALLOC_ENV)
    env = _undecided_environment()
    proc = subprocess.run([sys.executable, "-m", "ddpkit.cli", "launch", "--nproc-per-node",
                           "1", str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"seen {sorted(KEEP_LARGE_BLOCKS.items())}" in proc.stdout, proc.stdout[-2000:]


STEPS_OF_A_BIG_LAYER = """
import os, resource, tempfile
import torch, torch.distributed as dist
import ddpkit

torch.set_num_threads(1)
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = ddpkit.DataParallel(torch.nn.Linear(4096, 4096, bias=False))  # a 64 MiB gradient
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
faults = []
for step in range(15):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    opt.zero_grad()
    model(torch.randn(8, 4096)).square().mean().backward()
    opt.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults[8:])  # once the heap has settled
dist.destroy_process_group()
"""


def _faults_per_step(*env_extras):
    """Run the program once per environment (at the same time); the faults of a step of
    each, once its heap has settled (glibc reuses a freed 64-byte-aligned block only after
    several steps have left free neighbours to merge with)."""
    env = _undecided_environment()
    procs = [subprocess.Popen([sys.executable, "-c", STEPS_OF_A_BIG_LAYER], cwd=ROOT,
                              env={**env, **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for extra in env_extras]
    faults = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        faults.append(sorted(map(int, out.split()))[3])  # the median of the last 7 steps
    return faults


def test_a_process_not_started_by_the_launcher_gets_them_from_data_parallel():
    """A script run by plain torchrun: wrapping a CPU model applies the settings in place,
    so each step's 64 MiB gradient reuses the heap instead of faulting 16384 pages in."""
    pages = (1 << 26) // os.sysconf("SC_PAGE_SIZE")
    applied, opted_out = _faults_per_step({}, {"DDPKIT_SYSTEM_MALLOC": "1"})
    assert applied < pages // 10, applied
    assert opted_out > pages, opted_out  # glibc's defaults: a fresh mapping every step
