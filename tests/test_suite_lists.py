"""conftest's hand-kept lists name what exists: every id in SLOW a collected test, every
file in LAYERS a test file. A renamed test would otherwise leave its slow marker behind
and fall silently into the fast set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import LAYERS, LONGEST_FIRST, SLOW

TESTS = Path(__file__).parent


def collected_names() -> dict[str, set[str]]:
    """file name -> every name SLOW may use for its tests: the function's name and each
    parametrization's (what pytest_collection_modifyitems matches)."""
    files = sorted(str(TESTS / name) for name in SLOW if (TESTS / name).exists())
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-o", "addopts=", *files],
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        path, sep, rest = line.partition("::")
        if not sep:
            continue
        name = rest.rpartition("::")[2]
        names.setdefault(Path(path).name, set()).update({name, name.partition("[")[0]})
    return names


def stale_slow_ids(slow: dict[str, set[str]], collected: dict[str, set[str]]) -> list[str]:
    return sorted(f"{file}::{test}" for file, tests in slow.items()
                  for test in tests if test not in collected.get(file, ()))


def test_every_slow_id_names_a_collected_test():
    collected = collected_names()
    assert sum(len(v) for v in collected.values()) > 100, collected  # the collection ran
    stale = stale_slow_ids(SLOW, collected)
    assert not stale, f"SLOW (tests/conftest.py) names tests that no longer exist: {stale}"


def test_a_stale_slow_id_is_reported():
    collected = {"test_a.py": {"test_x", "test_x[2]", "test_y"}}
    slow = {"test_a.py": {"test_x", "test_x[3]", "test_y"}, "test_gone.py": {"test_z"}}
    assert stale_slow_ids(slow, collected) == ["test_a.py::test_x[3]", "test_gone.py::test_z"]


def test_every_file_in_layers_exists_and_every_test_file_has_a_layer():
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert sorted(set(LAYERS) - files) == [], "LAYERS names files that do not exist"
    assert sorted(files - set(LAYERS)) == [], "test files without a layer in LAYERS"
    assert sorted(set(LONGEST_FIRST) - files) == [], "LONGEST_FIRST names missing files"
