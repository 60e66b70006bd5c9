"""CPU seconds per test file of the test suite: a pytest plugin, and its summary.

The suite is mostly processes that start, import torch and end, so the wall time of a
test says little about the work it costs the machine; this records each test's CPU
seconds (its pytest worker's own, plus those of the children it waited for) and sums
them per file.

    PYTHONPATH=benchmarks SUITE_CPU_OUT=/tmp/suite_cpu .venv/bin/python -m pytest -p suite_cpu
    .venv/bin/python benchmarks/suite_cpu.py /tmp/suite_cpu

Processes that outlive their test (the session's gloo pools) are counted where they are
joined: on the test whose teardown ends the session on that worker.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time

import pytest

OUT_ENV = "SUITE_CPU_OUT"
_rows: list[tuple[str, float, float]] = []  # (test id, wall s, CPU s)


def _cpu_seconds() -> float:
    mine = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    _rows.append((item.nodeid, time.monotonic() - wall, _cpu_seconds() - cpu))


def pytest_sessionfinish(session):
    out = os.environ.get(OUT_ENV)
    if out:  # one file per xdist worker (or "main" without xdist)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{out}.{worker}.json", "w") as f:
            json.dump(_rows, f)


def summary(prefix: str, top: int = 30) -> str:
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for path in sorted(glob.glob(f"{prefix}.*.json")):
        with open(path) as f:
            for test_id, wall, cpu in json.load(f):
                entry = files[test_id.split("::")[0]]
                entry[0] += 1
                entry[1] += wall
                entry[2] += cpu
    lines = [f"{'file':40} {'tests':>5} {'wall s':>8} {'CPU s':>8}"]
    for name, (count, wall, cpu) in sorted(files.items(), key=lambda kv: -kv[1][2])[:top]:
        lines.append(f"{name:40} {count:5d} {wall:8.1f} {cpu:8.1f}")
    lines.append(f"{'all':40} {sum(e[0] for e in files.values()):5d} "
                 f"{sum(e[1] for e in files.values()):8.1f} "
                 f"{sum(e[2] for e in files.values()):8.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/suite_cpu.py PREFIX  (the run's SUITE_CPU_OUT)")
    print(summary(sys.argv[1]))
