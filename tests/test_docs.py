"""The docs are run, so a page cannot drift from the code.

Every ```sh / ```bash / ```python / ```toml block of README.md and docs/*.md (new pages
are picked up by themselves) is checked, page by page, in a scratch directory where
``examples/``, ``benchmarks/`` and ``tests/`` of the repository are at hand:

* sh, bash: each block runs in ``bash -euo pipefail``, the page's blocks in order (a
  later block sees the files an earlier one wrote), before its Python blocks;
* python: each block runs as a program, in fresh globals as ``__main__``, in its page's
  directory, after the page's shell blocks; the page's one-process blocks share one
  interpreter (importing torch is most of their cost), and the 2-rank blocks of every
  page share one ``ddpkit launch`` (a launch costs more than all the blocks it runs):
  each block builds its process group with ``ddpkit.distributed()`` and tears it down,
  and the next one builds a fresh group, as ``ddpkit.init`` allows. A 2-rank block that
  fails ends that launch; the blocks after it are run in a new one;
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
import traceback
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
                # They share one launch: each must leave with its group torn down, and
                # the next must build its own on fresh keys, which ddpkit's init does.
                assert "ddpkit.distributed(" in b.code, (
                    f"{b.where}: a 2-rank block builds its group with ddpkit.distributed()")
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
import os, runpy, sys, traceback
for path in list(sys.argv[1:]):
    os.chdir(os.path.dirname(path))  # the block's page directory
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
    print(f"DOCS-CHECK OK {path}", flush=True)
"""


class RunFailed(Exception):
    """A block (or a launch of blocks) failed; the message says which, with the tail of
    its output; ``stdout`` is all of it."""

    def __init__(self, message: str, stdout: str):
        super().__init__(message)
        self.stdout = stdout


def run(argv: list[str], cwd: Path, what: str, timeout: float = 300) -> str:
    """Run ``argv``; its stdout, or :class:`RunFailed` with the tail of its output."""
    # Its own session: on a timeout the launcher and every rank it started go together.
    proc = subprocess.Popen(argv, cwd=cwd, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise RunFailed(f"{what} did not finish in {timeout:.0f} s:\n--- stdout\n"
                        f"{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}", stdout) from None
    if proc.returncode != 0:
        raise RunFailed(f"{what} failed (exit {proc.returncode}):\n--- stdout\n{stdout[-3000:]}"
                        f"\n--- stderr\n{stderr[-3000:]}", stdout)
    return stdout


@dataclass
class PageRun:
    """What checking one page found: skipped blocks, the first failure, and the 2-rank
    blocks still to run (written into the page's directory)."""

    page: str
    skipped: list[str]
    two_ranks: list[str]
    failure: str | None = None


def run_page_alone(page: str, tmp_path: Path) -> PageRun:
    """Run the page's toml, shell and one-process blocks; collect its 2-rank blocks."""
    from ddpkit.train.config import Config
    from ddpkit.train.config_values import read_toml

    cwd = scratch(tmp_path)
    result = PageRun(page, [], [])
    one_process = []
    try:
        for n, b in enumerate(blocks(page)):
            if b.skipped:
                result.skipped.append(f"{b.where}: {b.skipped}")
                continue
            if b.lang == "toml":
                path = cwd / f"block_{n:02d}.toml"
                path.write_text(b.code)
                Config().replaced((read_toml(path), b.where))
                continue
            if b.lang in ("sh", "bash"):
                args = b.marker.removeprefix("run with:").strip() if b.marker.startswith(
                    "run with:") else ""
                run(["bash", "-euo", "pipefail", "-c", with_small_settings(b.code, args)],
                    cwd, b.where)
                continue
            path = cwd / f"block_{n:02d}_line{b.line}.py"
            path.write_text(b.code)
            (result.two_ranks if b.marker.startswith("run on 2 ranks") else one_process).append(
                str(path))
        driver = cwd / "run_blocks.py"
        driver.write_text(DRIVER)
        if one_process:
            run([sys.executable, str(driver), *one_process], cwd, f"{page}: Python blocks")
    except RunFailed as failed:
        result.failure, result.two_ranks = str(failed), []
    except Exception:  # a toml block the config refuses
        result.failure, result.two_ranks = traceback.format_exc(), []
    return result


def run_on_two_ranks(runs: list[PageRun], cwd: Path) -> None:
    """Run every page's 2-rank blocks, in page order, in as few launches as they allow."""
    driver = cwd / "run_blocks.py"
    driver.write_text(DRIVER)
    owner = {path: r for r in runs for path in r.two_ranks}
    todo = [path for r in runs for path in r.two_ranks]
    while todo:
        try:
            run([os.path.join(BIN, "ddpkit"), "launch", "--nproc-per-node", "2", str(driver),
                 *todo], cwd, "ddpkit launch of the 2-rank blocks")
            return
        except RunFailed as failed:
            # A block passed once both ranks said so; the first that did not is the one
            # that failed (or hung). The blocks after it never ran: a new launch runs them.
            first = next((i for i, path in enumerate(todo)
                          if failed.stdout.count(f"DOCS-CHECK OK {path}") < 2), len(todo) - 1)
            culprit = owner[todo[first]]
            culprit.failure = f"{culprit.page}: {os.path.basename(todo[first])}: {failed}"
            todo = [path for path in todo[first + 1:] if owner[path] is not culprit]


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory) -> dict[str, PageRun]:
    """Check the pages this session selected: each page's own blocks, then all their 2-rank
    blocks in one launch."""
    selected = [item.callspec.params["page"] for item in request.session.items
                if item.module is request.module and item.originalname == "test_page_runs"]
    runs = [run_page_alone(page, tmp_path_factory.mktemp(re.sub(r"\W", "_", page)))
            for page in selected]
    run_on_two_ranks(runs, tmp_path_factory.mktemp("two_ranks"))
    return {r.page: r for r in runs}


@pytest.mark.parametrize("page", pages())
def test_page_runs(page, page_runs):
    result = page_runs[page]
    # Shown with -rA / on failure: what this page leaves unrun, and why.
    print("\n".join(result.skipped))
    if result.failure:
        pytest.fail(result.failure, pytrace=False)


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
            "  --steps 2\nddpkit plan project\nddpkit bench collectives --nproc-per-node 2\n")
    settings = "train --epochs 1; verify --dtype float64; bench collectives --sizes 1K"
    assert with_small_settings(code, settings) == (
        "ddpkit train --lr 1 --epochs 1  # note\necho ddpkit train\n"
        "  ddpkit verify    --steps 2 --dtype float64\nddpkit plan project\n"
        "ddpkit bench collectives --nproc-per-node 2 --sizes 1K\n")
