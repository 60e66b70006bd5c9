"""Every ``ddpkit ...`` command line the docs show parses with the real parser.

tests/test_docs.py runs the shell blocks it can run here; this test reads every command
line of README.md and docs/*.md, run or not (a two-node command, a GPU command, a table
row, an inline code span), and parses it: with ``ddpkit.cli``'s parser, and for
``ddpkit launch`` also with torchrun's parser (``ddpkit.launcher.torchrun_args``), and for
``ddpkit slurm ... -- train ARGS`` also the ``ddpkit train ARGS`` it runs. A command that
parses but uses an old flag spelling (a note on stderr) fails too.

Where the commands are:

* fenced blocks in ``sh``, ``bash``, ``text`` or no language: each shell command (split at
  ``;``, ``&&``, ``||``, ``|``) from its ``ddpkit`` word on (``.venv/bin/ddpkit``, after
  ``srun``, ``mpirun -n 4``, ``timeout 480``, ``VAR=value`` alike);
* inline code spans that start with ``ddpkit `` (after ``VAR=value`` words).

Names, not command lines: ``ddpkit`` and command words alone (``ddpkit launch``,
``ddpkit plan``) name a command, which must exist (its ``--help`` is parsed); a command
word that is a placeholder (``ddpkit COMMAND``, ``ddpkit <cmd>``) names any command.

Not commands, by rule: a line or span whose command words end in ``:`` is what a command
prints (``ddpkit plan project: error: ...``); a span or line followed by ``<!-- not a
command: REASON -->``, or a block whose fence follows that line, is an excerpt on purpose
(REASON required). Python, TOML and diff blocks hold no command lines.

Placeholders, replaced before parsing (``substitute``):

* ``...`` and ``…``: dropped (more of the same); in a ``ddpkit launch`` line that names
  no script, they stand for the script and its arguments (``script.py``);
* ``ARGS``: dropped (a program's own arguments); ``--foo``: dropped (the flag one is
  about to add, in architecture.md's how-to);
* ``[X]`` -> ``X`` and ``A|B`` (``A\\|B`` in a table) -> ``A``: the synopsis is checked
  with its optional parts given, first choice taken;
* ``<anything>`` -> ``x``, ``$NAME`` -> ``2``, and a word in capitals (``N``, ``K``,
  ``RUN_DIR``, ``SCRIPT``, ``H:P``, ``OUT``) -> ``2`` (parses as a number or a name).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT
from ddpkit import cli
from ddpkit.errors import DdpkitError
from ddpkit.launcher import torchrun_args

COMMAND_LANGS = {"", "sh", "bash", "text", "console"}
FENCE = re.compile(r"^\s*```(\S*)\s*$")
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
NOT_A_COMMAND = re.compile(r"^\s*<!--\s*not a command:\s*(\S.*?)\s*-->")
CAPITALS = re.compile(r"(?<![\w.-])[A-Z][A-Z0-9_]*(?::[A-Z][A-Z0-9_]*)?(?![\w.])")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    text: str  # as the page shows it


def pages() -> list[Path]:
    return [Path(ROOT, "README.md"), *sorted(Path(ROOT, "docs").glob("*.md"))]


def substitute(text: str) -> str:
    """The placeholders of a shown command line, replaced by values that parse."""
    text = text.replace("\\|", "|").replace("…", " ").replace("...", " ")
    text = re.sub(r"(?<![\w-])(ARGS|--foo)(?![\w-])", " ", text)
    text = re.sub(r"<[^<>]*>", "x", text)
    text = re.sub(r"\$\{?\w+\}?", "2", text)
    text = re.sub(r"\[([^\[\]]*)\]", r" \1 ", text)
    text = re.sub(r"(?<=[\w.:,-])\|[\w.:,|-]+", "", text)  # A|B|C -> A
    return CAPITALS.sub("2", text)


def ddpkit_words(line: str) -> list[list[str]]:
    """The ``ddpkit ...`` commands of one shell line, as words."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:  # an apostrophe in a line of output: its words as they are
        words = line.split("#")[0].split()
    commands, current = [], []
    for word in [*words, ";"]:
        if word in SEPARATORS:
            start = next((i for i, w in enumerate(current) if Path(w).name == "ddpkit"), None)
            if start is not None:
                commands.append(current[start:])
            current = []
        else:
            current.append(word)
    return commands


def is_output(words: list[str]) -> bool:
    """``ddpkit train: error: ...``, ``ddpkit plan project: ...``: what a command prints."""
    return any(w.endswith(":") for w in words[1:3])


def names_any_command(words: list[str]) -> bool:
    return len(words) > 1 and bool(re.fullmatch(r"<[^>]*>?|[A-Z]+", words[1]))


def marked_not_a_command(rest_of_line: str, next_line: str) -> bool:
    return bool(NOT_A_COMMAND.match(rest_of_line) or NOT_A_COMMAND.match(next_line))


def commands(page: Path) -> list[Command]:
    """Every ``ddpkit`` command line shown on ``page`` (less the output and marked lines)."""
    lines = page.read_text().splitlines()
    name = os.path.relpath(page, ROOT)
    found: list[Command] = []
    in_block, lang, excerpt, i = False, "", False, 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            in_block, lang = (not in_block), fence.group(1)
            excerpt = in_block and i > 0 and marked_not_a_command(lines[i - 1], "")
            i += 1
            continue
        start = i
        if in_block:
            while line.endswith("\\") and i + 1 < len(lines):  # a continued shell line
                i += 1
                line = line[:-1] + " " + lines[i]
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if (lang in COMMAND_LANGS and "ddpkit " in line and not excerpt
                    and not marked_not_a_command("", nxt)):
                found += [Command(f"{name}:{start + 1}", " ".join(words))
                          for words in ddpkit_words(line)
                          if not is_output(words) and not names_any_command(words)]
        else:
            for span in SPAN.finditer(line):
                words = re.sub(r"^(\w+=\S*\s+)+", "", span.group(1)).split()
                if (words[:1] == ["ddpkit"] and len(words) > 1 and not is_output(words)
                        and not names_any_command(words)
                        and not marked_not_a_command(line[span.end():], "")):
                    found.append(Command(f"{name}:{i + 1}", span.group(1)))
        i += 1
    return found


def parse_problem(shown: str) -> str | None:
    """Why ``shown`` does not parse as the docs mean it, or None when it does."""
    argv = ddpkit_words(substitute(shown))[0]
    start = next(i for i, w in enumerate(argv) if Path(w).name == "ddpkit")
    argv = argv[start + 1:]
    if all(re.fullmatch(r"[a-z]+", w) for w in argv):  # names a command: it exists
        argv.append("--help")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = cli.parse_command_line(cli.build_parser(), argv)
            if args.command == "launch":
                torchrun_argv = args.torchrun_argv
                launch = torchrun_args.build_parser()
                script = launch.parse_known_args([*torchrun_argv, "x"])[0].training_script
                if script == "x" and ("..." in shown or "…" in shown):
                    torchrun_argv = [*torchrun_argv, "script.py"]  # `...`: the script
                launch.parse_args(torchrun_argv)
            job = [w for w in getattr(args, "job", None) or [] if w != "--"]
            if args.command == "slurm" and job[:1] == ["train"]:
                cli.parse_command_line(cli.build_parser(), job)
    except SystemExit as stop:
        if stop.code not in (0, None):  # --help, --version: 0
            return err.getvalue().strip() or f"exit {stop.code}"
    except DdpkitError as refused:  # torchrun's parser, in ddpkit launch's words
        return f"ddpkit launch: error: {refused}"
    if err.getvalue().strip():  # an old spelling's note
        return err.getvalue().strip()
    return None


ALL = [c for page in pages() for c in commands(page)]


@pytest.mark.parametrize("shown", ALL, ids=[c.where for c in ALL])
def test_every_command_line_in_the_docs_parses(shown: Command):
    problem = parse_problem(shown.text)
    assert problem is None, f"{shown.where}: `{shown.text}`: {problem}"


def test_every_not_a_command_marker_says_why():
    for page in pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "not a command" in line:
                assert re.search(r"<!--\s*not a command:\s*\S", line), f"{page.name}:{n}"


def test_the_check_finds_commands_everywhere_and_catches_a_bad_one(tmp_path):
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text(
        "Run `ddpkit launch --nproc 2 train.py` or `ddpkit train --epochs N`; it prints\n"
        "`ddpkit train: error: ...`.\n\n"
        "```sh\ncd x && .venv/bin/ddpkit verify \\\n  --steps 2   # comment\n"
        "srun ddpkit bench collectives --nproc 2 | tee log\n```\n\n"
        "`ddpkit train --nosuch` <!-- not a command: the mistake the page shows -->\n"
        "`ddpkit <cmd> ...`, `ddpkit launch`, `ddpkit lanuch`, `ddpkit launch --tee 3 ...`\n")
    found = [c.text for c in commands(page)]
    assert found == ["ddpkit launch --nproc 2 train.py", "ddpkit train --epochs N",
                     ".venv/bin/ddpkit verify --steps 2", "ddpkit bench collectives --nproc 2",
                     "ddpkit launch", "ddpkit lanuch", "ddpkit launch --tee 3 ..."]
    problems = [parse_problem(text) for text in found]
    # torchrun's parser: --nproc is ambiguous there (--nproc-per-node, --nproc_per_node)
    assert problems[0] and "ambiguous option: --nproc" in problems[0]
    assert problems[1] is None and problems[2] is None
    assert problems[3] and "--nproc is now --nproc-per-node" in problems[3]
    assert problems[4] is None and problems[6] is None  # a name; `...`: the script
    assert problems[5] and "invalid choice: 'lanuch'" in problems[5]


def test_placeholders_become_values_that_parse():
    assert substitute("ddpkit train --resume [RUN_DIR] --data digits\\|mnist ...").split() == [
        "ddpkit", "train", "--resume", "2", "--data", "digits"]
    assert substitute("ddpkit launch --nnodes $SLURM_NNODES --rdzv-endpoint $head:29400 "
                      "<script>").split() == [
        "ddpkit", "launch", "--nnodes", "2", "--rdzv-endpoint", "2:29400", "x"]
    assert substitute("--rdzv-endpoint H:P --lr-schedule constant|cosine").split() == [
        "--rdzv-endpoint", "2", "--lr-schedule", "constant"]


def test_no_page_shows_an_old_process_count_spelling():
    """The prose too (a flag named alone is no command line): one name per idea; a span
    marked ``not a command``, or what a command prints, may show one (bad-inputs.md's
    row on old spellings)."""
    old = re.compile(r"(?<![\w-])(--nproc|--tasks-per-node)(?![\w-])")
    marked = re.compile(r"`[^`]*`\s*<!--\s*not a command:[^>]*-->")

    def prose(line: str) -> str:
        line = marked.sub("", line)
        return SPAN.sub(lambda s: "" if is_output(s.group(1).split()) else s.group(0), line)

    shown = [f"{page.name}:{n}: {m.group(1)}" for page in pages()
             for n, line in enumerate(page.read_text().splitlines(), 1)
             for m in old.finditer(prose(line))]
    assert shown == []
    assert old.search("`--nproc 2`") and old.search("--tasks-per-node N")
    assert not old.search("--nproc-per-node --ntasks-per-node --nproc_per_node")
