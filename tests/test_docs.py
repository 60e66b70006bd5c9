"""The docs are run, so a page cannot drift from the code.

Every ```sh / ```bash / ```python / ```toml block of README.md and docs/*.md (new pages
are picked up by themselves) is checked, page by page, in a scratch directory where
``examples/``, ``benchmarks/`` and ``tests/`` of the repository are at hand:

* sh, bash: each block runs in ``bash -euo pipefail``, the page's blocks in order (a
  later block sees the files an earlier one wrote), before its Python blocks;
* python: each block runs as a program, in fresh globals as ``__main__``; the page's
  one-process blocks share one interpreter (importing torch is most of their cost),
  each 2-rank block gets its own ``ddpkit launch`` (blocks that stop ranks with signals
  or build process groups must not leave state to the next);
* toml: read as a ``ddpkit train --config`` file (unknown keys and wrong types fail).

The line right before a block's opening fence may say how (an HTML comment, invisible
on the rendered page):

``<!-- not run: REASON -->``
    not executed: it needs several machines, a GPU, a download, another package, or it
    is an excerpt; REASON is required.
``<!-- run with: COMMAND ARGS; COMMAND ARGS -->``
    sh: ARGS are appended to every ``ddpkit COMMAND`` line of the block (before a
    trailing comment; COMMAND may be two words, ``bench collectives``): the small
    settings the check runs it with, e.g. ``<!-- run with: train --epochs 1 -->``.
``<!-- run on 2 ranks -->``
    python: the block runs under ``ddpkit launch --nproc-per-node 2``.
``<!-- snippet: FILE -->``, ``<!-- before: ... -->``, ``<!-- diff: FILE -->``,
``<!-- commands: FILE -->``
    checked by tests/test_migrating.py against the example program it comes from.

Blocks without a language, or in another (``text``, ``diff``), are output, diagrams or
patches, and are not run.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT

RUN_LANGS = {"sh", "bash", "python", "toml"}
CHECKED_ELSEWHERE = ("snippet:", "before:", "diff:", "commands:")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
BIN = os.path.dirname(sys.executable)


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str  # the comment before the fence, or ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def skipped(self) -> str | None:
        """Why the block is not run here, or None."""
        if self.lang not in RUN_LANGS:
            return f"{self.lang or 'plain'} block"
        if self.marker.startswith("not run:"):
            return self.marker.removeprefix("not run:").strip()
        if self.marker.startswith(CHECKED_ELSEWHERE):
            return "checked by tests/test_migrating.py"
        return None


def pages() -> list[str]:
    found = ["README.md", *sorted(os.path.relpath(p, ROOT)
                                  for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    return found


def blocks(page: str) -> list[Block]:
    lines = Path(ROOT, page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not re.match(rf"^{indent}```\s*$", lines[j]):
            j += 1
        assert j < len(lines), f"{page}:{i + 1}: code block never closed"
        before = MARKER.match(lines[i - 1]) if i else None
        code = textwrap.dedent("\n".join(lines[i + 1:j]))
        out.append(Block(page, i + 1, lang, code + "\n", before.group(1) if before else ""))
        i = j + 1
    return out


def test_every_marker_is_known_and_every_skip_says_why():
    known = ("not run:", "run with:", "run on 2 ranks", *CHECKED_ELSEWHERE)
    for page in pages():
        for b in blocks(page):
            if b.marker and b.lang in RUN_LANGS:
                assert b.marker.startswith(known), f"{b.where}: unknown marker {b.marker!r}"
            if b.marker.startswith("not run:"):
                assert b.skipped, f"{b.where}: `not run:` needs a reason"
            if b.marker.startswith("run on 2 ranks"):
                assert b.lang == "python", f"{b.where}: only Python blocks run on ranks"
            if b.marker.startswith("run with:"):
                assert b.lang in ("sh", "bash"), f"{b.where}: `run with:` is for shell blocks"


def with_small_settings(code: str, settings: str) -> str:
    """Append each ``COMMAND ARGS`` of ``settings`` (``;``-separated) to every
    ``ddpkit COMMAND ...`` line of ``code``, before a trailing comment."""
    extra = {}
    for item in filter(None, (s.strip() for s in settings.split(";"))):
        words = item.split()
        split = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
        extra[" ".join(words[:split])] = " ".join(words[split:])
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        command, hash_, comment = line.partition(" #")
        words = command.split()
        for key in sorted(extra, key=len, reverse=True):
            if words[:1] == ["ddpkit"] and words[1:1 + len(key.split())] == key.split():
                line = f"{command.rstrip()} {extra[key]}" + (f"  #{comment}" if hash_ else "")
                break
        out.append(line)
    return "\n".join(out) + "\n"


def scratch(tmp_path: Path) -> Path:
    for name in ("examples", "benchmarks", "tests"):
        (tmp_path / name).symlink_to(Path(ROOT, name))
    return tmp_path


def environment() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "tests")}


DRIVER = """
import runpy, sys, traceback
for path in list(sys.argv[1:]):
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            print(f"DOCS-CHECK FAILED {path}: exit {stop.code}", flush=True)
            sys.exit(1)
    except BaseException:
        traceback.print_exc()
        print(f"DOCS-CHECK FAILED {path}", flush=True)
        sys.exit(1)
"""


def run(argv: list[str], cwd: Path, what: str, timeout: float = 300) -> None:
    # Its own session: on a timeout the launcher and every rank it started go together.
    proc = subprocess.Popen(argv, cwd=cwd, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout:.0f} s:\n{stderr[-3000:]}",
                    pytrace=False)
    proc = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    assert proc.returncode == 0, (
        f"{what} failed (exit {proc.returncode}):\n--- stdout\n{proc.stdout[-3000:]}"
        f"\n--- stderr\n{proc.stderr[-3000:]}")


def check_page(page: str, tmp_path: Path) -> list[str]:
    """Run the page's blocks; returns what was skipped and why."""
    from ddpkit.train.config import Config, read_toml

    cwd = scratch(tmp_path)
    skipped, one_process, two_ranks = [], [], []
    for n, b in enumerate(blocks(page)):
        if b.skipped:
            skipped.append(f"{b.where}: {b.skipped}")
            continue
        if b.lang == "toml":
            path = cwd / f"block_{n:02d}.toml"
            path.write_text(b.code)
            Config().update(read_toml(path), source=b.where)
            continue
        if b.lang in ("sh", "bash"):
            args = b.marker.removeprefix("run with:").strip() if b.marker.startswith(
                "run with:") else ""
            run(["bash", "-euo", "pipefail", "-c", with_small_settings(b.code, args)], cwd,
                b.where)
            continue
        path = cwd / f"block_{n:02d}_line{b.line}.py"
        path.write_text(b.code)
        (two_ranks if b.marker.startswith("run on 2 ranks") else one_process).append(str(path))
    driver = cwd / "run_blocks.py"
    driver.write_text(DRIVER)
    if one_process:
        run([sys.executable, str(driver), *one_process], cwd, f"{page}: Python blocks")
    for path in two_ranks:
        run([os.path.join(BIN, "ddpkit"), "launch", "--nproc-per-node", "2", str(driver),
             path], cwd, f"{page}: {os.path.basename(path)} on 2 ranks")
    return skipped


@pytest.mark.parametrize("page", pages())
def test_page_runs(page, tmp_path):
    skipped = check_page(page, tmp_path)
    # Shown with -rA / on failure: what this page leaves unrun, and why.
    print("\n".join(skipped))


def test_training_options_table_lists_every_train_option():
    from ddpkit import cli

    parser = cli.build_parser()
    (train,) = [a for a in parser._actions if hasattr(a, "choices") and a.choices
                and "train" in a.choices]
    text = Path(ROOT, "docs", "training.md").read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `--"))
    missing = [flags[0] for a in train.choices["train"]._actions
               if (flags := [s for s in a.option_strings if s.startswith("--")])
               and flags[0] != "--help" and not any(f"`{f}" in table for f in flags)]
    assert not missing, f"docs/training.md's options table lacks {missing}"


def test_small_settings_go_to_their_command_before_the_comment():
    code = ("ddpkit train --lr 1  # note\necho ddpkit train\n  ddpkit verify \\\n"
            "  --steps 2\nddpkit plan project\nddpkit bench collectives --nproc 2\n")
    settings = "train --epochs 1; verify --dtype float64; bench collectives --sizes 1K"
    assert with_small_settings(code, settings) == (
        "ddpkit train --lr 1 --epochs 1  # note\necho ddpkit train\n"
        "  ddpkit verify    --steps 2 --dtype float64\nddpkit plan project\n"
        "ddpkit bench collectives --nproc 2 --sizes 1K\n")
