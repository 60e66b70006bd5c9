"""Renamed flags: the old spelling keeps working for one release, with a note.

A command declares its flags under their one name; ``keep_old_spelling(parser, old,
new)`` then accepts ``old`` too, hidden from ``--help``, doing exactly what ``new``
does after one line on stderr, e.g. ``ddpkit bench collectives: note: --nproc is now
--nproc-per-node; the old spelling goes in the next release``.
"""

from __future__ import annotations

import argparse
import sys


class OldSpelling(argparse.Action):
    def __init__(self, option_strings, dest, *, new: argparse.Action, **_ignored):
        # SUPPRESS: the old spelling never puts a default of its own in the namespace.
        super().__init__(option_strings, dest, nargs=new.nargs, const=new.const,
                         default=argparse.SUPPRESS, type=new.type, choices=new.choices,
                         metavar=new.metavar, help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        name = self.new.option_strings[0]
        print(f"{parser.prog}: note: {option_string} is now {name}; the old spelling goes "
              "in the next release", file=sys.stderr)
        self.new(parser, namespace, values, name)


def keep_old_spelling(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Accept ``old`` as ``new`` (already added to ``parser``), with the note."""
    target = parser._option_string_actions[new]
    parser.add_argument(old, dest=target.dest, action=OldSpelling, new=target)


# old spelling -> new, per command; the parsers and the docs' check read it.
RENAMED = {
    "bench collectives": {"--nproc": "--nproc-per-node"},
    "bench shm": {"--nproc": "--nproc-per-node"},
    "plan calibrate": {"--nproc": "--nproc-per-node"},
    "slurm": {"--tasks-per-node": "--ntasks-per-node", "--log": "--output",
              "--script": "--out"},
}


def keep_old_spellings(parser: argparse.ArgumentParser, command: str) -> None:
    """Every old spelling of ``command`` (its words after ``ddpkit``) that RENAMED lists."""
    for old, new in RENAMED.get(command, {}).items():
        keep_old_spelling(parser, old, new)
