"""The README's two commands are the ones CI and users run: keep them true."""

import re
from pathlib import Path

from conftest import ROOT


def readme_commands():
    text = Path(ROOT, "README.md").read_text()
    return re.findall(r"```sh\n(.+?)\n```", text)[:2]


def test_ci_runs_the_readme_test_command():
    main_cmd, test_cmd = readme_commands()
    assert "pytest" in test_cmd and "constraints.txt" in test_cmd
    assert test_cmd in Path(ROOT, ".ci/run").read_text().splitlines()
    assert "constraints.txt" in main_cmd  # never an unpinned (CUDA) torch on a fresh machine


def test_constraints_pin_cpu_torch():
    pins = Path(ROOT, "requirements/constraints.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", pins, re.M)
