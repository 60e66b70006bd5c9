"""The CLI explains itself: every --help is clean text with a description and a default
for every option, and every mistake is one line naming the command and the option."""

from __future__ import annotations

import argparse
import re

import pytest

from ddpkit import cli

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
        if not action.option_strings or isinstance(action, HELP_ACTIONS):
            continue
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
    assert not flags & {"--epochs", "--out-dir", "--no-progress", "--max-restarts"}


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
