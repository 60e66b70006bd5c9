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
