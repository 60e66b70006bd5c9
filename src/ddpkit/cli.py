"""The ``ddpkit`` command: one subcommand per module in ``ddpkit.commands``.

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int``. User errors (:class:`DdpkitError`) become one line on stderr and
exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ddpkit.errors import DdpkitError

# Order here is the order in `ddpkit --help`.
COMMANDS = ("train", "verify", "launch", "topology", "bench", "plan", "slurm", "env")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddpkit")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """A bad flag or value is one line (not argparse's usage block first), exit 2.
    Subcommand parsers are of the same class."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ddpkit", description="Distributed data-parallel training on PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"ddpkit.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ddpkit.log import configure_cli_logging

    configure_cli_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DdpkitError as err:
        print(f"ddpkit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ddpkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
