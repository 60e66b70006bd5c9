"""The ``ddpkit`` command: one subcommand per module in ``ddpkit.commands``.

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int``. User errors (:class:`DdpkitError`) become one line on stderr and
exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
from typing import NoReturn

from ddpkit.errors import DdpkitError
from ddpkit.help_text import plain

# Order here is the order in `ddpkit --help`.
COMMANDS = ("train", "verify", "launch", "topology", "bench", "plan", "slurm", "env")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddpkit")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions are wrapped by paragraph, indented lines (commands) kept as written;
    every option says its default (or that it is required); no markup reaches the
    terminal."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for block in re.split(r"\n\s*\n", plain(text).strip("\n")):
            lines = block.splitlines()
            if any(line.startswith(" ") for line in lines):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(textwrap.fill(" ".join(lines), width, initial_indent=indent,
                                                subsequent_indent=indent))
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain(action.help or "")
        if not action.option_strings or "default" in text or text == argparse.SUPPRESS:
            return text
        if action.required:
            return f"{text} (required)"
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreConstAction)):
            return f"{text} (default: off)"
        if action.default is not None and action.default is not argparse.SUPPRESS:
            return f"{text} (default: %(default)s)"
        return text

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))


class _Parser(argparse.ArgumentParser):
    """A bad flag or value is one line naming the command (not argparse's usage block
    first), exit 2. Subcommand parsers are of the same class and format their help with
    :class:`HelpFormatter`."""

    def __init__(self, *args, **kwargs):
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)
        self.set_defaults(_parser=self)  # the innermost parser that ran wins

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ddpkit", description="Distributed data-parallel training on PyTorch. "
        "Run `ddpkit COMMAND --help` for a command's options."
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {package_version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"ddpkit.commands.{name}").register(sub)
    _describe_from_help(parser)
    return parser


def _describe_from_help(parser: argparse.ArgumentParser) -> None:
    """A (sub)command registered without a description shows its one-line help as one
    in its own --help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for listed in action._choices_actions:
                child = action.choices[listed.dest]
                if not child.description and listed.help:
                    child.description = listed.help[0].upper() + listed.help[1:] + "."
                _describe_from_help(child)


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; a mistake is reported by the (sub)command it belongs to."""
    if not argv:
        parser.error(f"give a command: {', '.join(COMMANDS)}")
    first = argv[0]
    if first.startswith("-") and first not in ("-h", "--help", "--version"):
        parser.error(f"unknown option {first.split('=')[0]}: options go after the command "
                     f"(ddpkit COMMAND {first}); commands: {', '.join(COMMANDS)}")
    args, extra = parser.parse_known_args(argv)
    not_taken = getattr(args._parser, "not_taken", {})  # flags a command leaves out, and why
    for word in extra:
        flag = word.split("=")[0]
        if flag in not_taken:
            args._parser.error(f"{flag} is not a {args._parser.prog} option: {not_taken[flag]}")
    if extra:
        words = " ".join(extra)
        args._parser.error(f"unrecognized arguments: {words}")
    return args


def main(argv: list[str] | None = None) -> int:
    from ddpkit.log import configure_cli_logging

    configure_cli_logging()
    parser = build_parser()
    args = parse_command_line(parser, sys.argv[1:] if argv is None else list(argv))
    prog = args._parser.prog  # "ddpkit train", "ddpkit plan project", ...
    try:
        return int(args.func(args) or 0)
    except DdpkitError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The ``ddpkit`` program (its console script and ``python -m ddpkit.cli``): ``main``,
    then a success ends without the interpreter's finalization, as every worker does
    (:mod:`ddpkit.runtime.process_exit`): the launcher's agent imported torch, and its teardown
    is work nobody waits for. ``main`` itself returns, for callers in a process of their own."""
    from ddpkit.runtime.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    run()
