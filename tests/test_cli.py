"""The CLI explains itself: every --help is clean text with a description and a default
for every option, and every mistake is one line naming the command and the option."""

from __future__ import annotations

import argparse
import re

import pytest

from ddpkit import cli
from ddpkit.commands.old_spellings import RENAMED, OldSpelling
from ddpkit.launcher.torchrun_args import LAUNCH_OPTIONS, torchrun_spellings

HELP_ACTIONS = (argparse._HelpAction, argparse._VersionAction)


def parsers(parser: argparse.ArgumentParser):
    """The parser and every subcommand's, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from parsers(child)


ALL = list(parsers(cli.build_parser()))


def command_paths(parser: argparse.ArgumentParser, path=()):
    """Every command line that ends in --help: (), ("train",), ("plan", "project"), ..."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from command_paths(child, (*path, name))


COMMAND_PATHS = list(command_paths(cli.build_parser()))
# reST literals and roles, Markdown code spans and emphasis: what a terminal shows raw.
MARKUP = re.compile(r"`|:(?:class|func|mod|meth|data|attr|exc|obj):|\*\*")


@pytest.mark.parametrize("parser", ALL, ids=[p.prog for p in ALL])
def test_every_option_has_a_description_and_a_default(parser):
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (*HELP_ACTIONS, OldSpelling)):
            continue  # an old spelling is hidden: --help shows the one name
        assert action.help and action.help != argparse.SUPPRESS, (parser.prog, action)
        text = formatter._get_help_string(action)
        assert "default" in text or "(required)" in text, (parser.prog, action.option_strings)


@pytest.mark.parametrize("parser", ALL, ids=[p.prog for p in ALL])
def test_help_is_plain_text_with_a_description(parser):
    text = parser.format_help()
    assert "``" not in text and ":mod:" not in text and ":class:" not in text, parser.prog
    if parser.prog != "ddpkit launch":  # torchrun's own help, printed by its parser
        assert parser.description, parser.prog


@pytest.mark.parametrize("path", COMMAND_PATHS,
                         ids=[" ".join(p) or "ddpkit" for p in COMMAND_PATHS])
def test_printed_help_has_no_markup(path, capsys):
    """What `ddpkit ... --help` prints, torchrun's own help under `ddpkit launch` included."""
    with pytest.raises(SystemExit) as stop:
        cli.main([*path, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ")
    marked = [line.strip() for line in text.splitlines() if MARKUP.search(line)]
    assert marked == [], (path, marked)


def test_plain_strips_every_kind_of_markup():
    assert cli.plain("``--rdzv-backend=static``, :func:`~ddpkit.init`, `ddpkit train`") == (
        "--rdzv-backend=static, ddpkit.init, 'ddpkit train'")
    assert not MARKUP.search(cli.plain(":class:`World` and ``x``"))
    assert MARKUP.search("``x``") and MARKUP.search(":func:`f`") and MARKUP.search("**x**")


def test_help_formatter_says_defaults():
    p = cli._Parser(prog="x")
    p.add_argument("--n", type=int, default=3, help="count")
    p.add_argument("--flag", action="store_true", help="a switch")
    p.add_argument("--need", required=True, help="needed")
    text = p.format_help()
    assert "count (default: 3)" in text and "a switch (default: off)" in text
    assert "needed (required)" in text
    assert cli.plain("``ddpkit train`` and :mod:`ddpkit.comm`") == "ddpkit train and ddpkit.comm"


def test_verify_lists_only_options_it_uses():
    (verify,) = [p for p in ALL if p.prog == "ddpkit verify"]
    flags = {s for a in verify._actions for s in a.option_strings}
    assert {"--steps", "--dtype", "--lr", "--nproc-per-node"} <= flags
    assert not flags & {"--epochs", "--out-dir", "--no-progress", "--max-restarts",
                        "--lr-schedule", "--warmup-steps", "--clip-grad-norm", "--grad-accum",
                        "--precision"}


@pytest.mark.parametrize("flag", ["--precision", "--grad-accum", "--epochs"])
def test_a_train_flag_verify_leaves_out_is_one_line_saying_why(flag, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["verify", flag, "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"ddpkit verify: error: {flag} is not a ddpkit verify option: "), err


def _parse(argv: list[str]) -> dict:
    """The values a command line gives (less the parser objects themselves)."""
    args = vars(cli.parse_command_line(cli.build_parser(), argv))
    return {k: v for k, v in args.items() if k not in ("_parser", "func")}


OLD_SPELLINGS = [(command, old, new) for command, renamed in RENAMED.items()
                 for old, new in renamed.items()]


@pytest.mark.parametrize(("command", "old", "new"), OLD_SPELLINGS,
                         ids=[f"{c}:{o}" for c, o, _ in OLD_SPELLINGS])
def test_an_old_spelling_still_works_and_says_its_new_name(command, old, new, capsys):
    base = command.split() + (["--nodes", "2", "--gpus-per-node", "0"]
                              if command == "slurm" and old not in ("--nodes",) else [])
    value = "7"
    with_new = _parse([*base, new, value])
    assert capsys.readouterr().err == ""
    with_old = _parse([*base, old, value])
    assert with_old == with_new and str(with_new[new.lstrip("-").replace("-", "_")]) == value
    assert capsys.readouterr().err == (
        f"ddpkit {command}: note: {old} is now {new}; the old spelling goes in the next "
        "release\n")
    (parser,) = [p for p in ALL if p.prog == f"ddpkit {command}"]
    assert not re.search(rf"{old}\b(?!-)", parser.format_help())  # --help shows the one name


def test_one_name_per_idea_across_commands():
    """A process count, a node count, a file or directory to write: the same word in
    every command that has the idea (slurm's are sbatch's, as its users know them)."""
    by_flag = {s for p in ALL for a in p._actions if a.help != argparse.SUPPRESS
               for s in a.option_strings}
    assert not by_flag & {"--nproc", "--tasks-per-node", "--script", "--log"}
    (slurm,) = [p for p in ALL if p.prog == "ddpkit slurm"]
    shown = {s for a in slurm._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
    assert {"--nodes", "--gpus-per-node", "--ntasks-per-node", "--cpus-per-task", "--output",
            "--time", "--partition", "--account", "--job-name"} <= shown


def test_launch_options_are_torchruns_declared_once():
    """train and verify take LAUNCH_OPTIONS, each under torchrun's own spellings."""
    from torch.distributed.run import get_args_parser

    torchrun = {a.dest: set(a.option_strings) for a in get_args_parser()._actions}
    for flag in LAUNCH_OPTIONS:
        dest = flag[2:].replace("-", "_")
        assert set(torchrun_spellings(flag)) == torchrun[dest], flag
    for command, left_out in (("train", set()), ("verify", {"--max-restarts"})):
        (parser,) = [p for p in ALL if p.prog == f"ddpkit {command}"]
        (group,) = [g for g in parser._action_groups if g.title.startswith("launch")]
        assert [a.option_strings[0] for a in group._group_actions] == [
            f for f in LAUNCH_OPTIONS if f not in left_out]


@pytest.mark.parametrize(("argv", "line"), [
    (["train", "--nosuch"],
     "ddpkit train: error: unrecognized arguments: --nosuch (see ddpkit train --help)"),
    (["plan", "project", "--bogus", "3"],
     "ddpkit plan project: error: unrecognized arguments: --bogus 3"),
    (["--nosuch"], "ddpkit: error: unknown option --nosuch: options go after the command"),
    ([], "ddpkit: error: give a command: train, verify, launch"),
    (["plan", "project", "--params", "abc"],
     "ddpkit plan project: error: argument --params: invalid float value: 'abc'"),
    (["plan", "project", "--params", "-5"],
     "ddpkit plan project: error: --params must be a positive number, got -5"),
    (["topology", "--devices-per-node", "3", "--devices-per-process", "2"],
     "ddpkit topology: error: --devices-per-node 3 is not divisible by --devices-per-process"),
])
def test_a_mistake_is_one_line_naming_the_command_and_the_option(argv, line, capsys, tmp_path,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        raise SystemExit(cli.main(argv))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line), err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_verify_refuses_a_config_file_that_sets_what_it_leaves_out(tmp_path, capsys, clean_env):
    config = tmp_path / "run.toml"
    config.write_text('[train]\nprecision = "bf16"\n')
    assert cli.main(["verify", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("ddpkit verify: error: ddpkit verify compares plain optimizer "
                          "steps: leave out "), err
