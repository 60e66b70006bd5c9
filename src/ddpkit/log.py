"""A rank-aware logger: rank 0 speaks by default, every line says which rank it is.

With N processes writing to one terminal, unprefixed output from every rank is noise.
``get_logger`` returns an adapter that drops records on non-zero ranks unless the call
passes ``all_ranks=True``, prefixes ``[rank N]``, and offers ``warning_once``.

Library etiquette: importing ddpkit adds only a ``NullHandler`` to the "ddpkit" logger
and leaves propagation on, so an application's own ``logging`` setup (basicConfig,
pytest's caplog) sees ddpkit's records. Handlers belong to the application: the
``ddpkit`` command calls :func:`configure_cli_logging`, and marks the environment so the
worker processes it launches configure the same stderr handler when they import ddpkit.

Where those lines end on a terminal (the launcher says so in :data:`TERMINAL_COLUMNS_ENV`),
a line is for a person reading the run as it goes: the message alone, without the
clock, the level of an ordinary message or rank 0's name, fitted to the terminal's
width. Elsewhere (a log file, CI) every line keeps its time and level.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import textwrap


def _rank() -> int:
    # A process that never imported torch.distributed has no process group; importing
    # it here would cost a launcher (which has no torch) a second per first log line.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # Before init the launcher's variable is the only source of truth.
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)


class RankLogger(logging.LoggerAdapter):
    def log(self, level, msg, *args, all_ranks: bool = False, **kwargs):  # type: ignore[override]
        if not self.isEnabledFor(level):
            return
        rank = _rank()
        if rank != 0 and not all_ranks:
            return
        self.logger.log(level, f"[rank {rank}] {msg}", *args, **kwargs)

    def debug(self, msg, *args, **kwargs):
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg, *args, **kwargs):
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg, *args, **kwargs):
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg, *args, **kwargs):
        self.log(logging.ERROR, msg, *args, **kwargs)

    @functools.cache  # noqa: B019 - one warning per (logger, message) is the point
    def warning_once(self, msg: str, all_ranks: bool = False) -> None:
        self.warning(msg, all_ranks=all_ranks)


_CLI_MARK = "DDPKIT_CLI_LOGGING"
# Set by a launcher whose stderr is a terminal: the columns its workers' lines may take.
TERMINAL_COLUMNS_ENV = "DDPKIT_TERMINAL_COLUMNS"
_RANK0 = "[rank 0] "


class TerminalFormatter(logging.Formatter):
    """A record as a person at a terminal reads it: ``epoch 3/20: ...`` for rank 0's
    ordinary messages, ``warning: ...`` above INFO, ``[rank N] ...`` kept for the other
    ranks; a message wider than ``columns`` continues on indented lines, broken between
    words (a path or a command is never cut, so it can still be copied whole)."""

    def __init__(self, columns: int):
        super().__init__()
        self.columns = max(columns, 20)

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage().removeprefix(_RANK0)
        if record.levelno > logging.INFO:
            text = f"{record.levelname.lower()}: {text}"
        lines = [fitted for line in text.splitlines() or [""]
                 for fitted in textwrap.wrap(line, self.columns, subsequent_indent="  ",
                                             break_long_words=False,
                                             break_on_hyphens=False) or [""]]
        if record.exc_info:
            lines.append(self.formatException(record.exc_info))
        return "\n".join(lines)


def _stderr_formatter() -> logging.Formatter:
    columns = os.environ.get(TERMINAL_COLUMNS_ENV, "")
    if columns.isdigit():
        return TerminalFormatter(int(columns))
    return logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time, not at configuration time,
    so a replaced stderr (pytest's capture, a redirect) is never written after close."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_cli_logging() -> None:
    """Give the "ddpkit" logger a stderr handler (idempotent), for the ddpkit command.

    Also sets ``DDPKIT_CLI_LOGGING=1`` so processes this one launches (the workers of
    ``ddpkit train``/``launch``) do the same on import: they are part of the command.
    """
    os.environ[_CLI_MARK] = "1"
    root = logging.getLogger("ddpkit")
    if any(isinstance(h, _StderrHandler) for h in root.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(_stderr_formatter())
    root.addHandler(handler)
    root.setLevel(os.environ.get("DDPKIT_LOG_LEVEL", "INFO").upper())


def get_logger(name: str = "ddpkit") -> RankLogger:
    return RankLogger(logging.getLogger(name), {})


def _install_library_handler() -> None:
    root = logging.getLogger("ddpkit")
    if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
        root.addHandler(logging.NullHandler())
    if os.environ.get(_CLI_MARK) == "1":
        configure_cli_logging()


_install_library_handler()
