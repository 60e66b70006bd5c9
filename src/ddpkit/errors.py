"""Errors that ddpkit reports to users as one line, without a traceback.

Each class is also the builtin exception type torch raises in the same situation, so a
program written against torch (``except RuntimeError:`` around a DDP call,
``except ValueError:`` around a collective) catches ddpkit's error too, with ddpkit's
clearer message:

* :class:`ConfigError` is a ``ValueError`` (bad values: options, environment, sizes);
* :class:`ConfigTypeError` is also a ``TypeError`` (an argument of the wrong kind);
* :class:`UsageError` is a ``RuntimeError`` (a call the object's state refuses: a
  second comm hook, a parameter that got no gradient, a module with nothing to train);
* :class:`CommError` is a ``RuntimeError`` (a collective that cannot run as asked), and
  :class:`CommValueError` also a ``ValueError`` (an op torch refuses for that dtype).
"""

from __future__ import annotations

import os
import sys


class DdpkitError(Exception):
    """Base for errors whose message alone tells the user what is wrong and what to do.

    The CLI prints ``ddpkit: error: <message>`` and exits with code 2 instead of a
    traceback, so messages must name the offending value and the fix.
    """


class ConfigError(DdpkitError, ValueError):
    """Bad user input: environment variables, options, configuration values."""


class ConfigTypeError(ConfigError, TypeError):
    """An argument of the wrong kind (torch raises TypeError there)."""


class UsageError(DdpkitError, RuntimeError):
    """A call refused in the object's current state (torch raises RuntimeError there)."""


class CommError(DdpkitError, RuntimeError):
    """A collective that cannot run as asked (raised before any communication)."""


class CommValueError(CommError, ValueError):
    """A collective whose op and dtype torch refuses with ValueError (max of complex)."""


# Set by `ddpkit launch` for the processes it starts (see install_one_line_errors).
ONE_LINE_ERRORS_ENV = "DDPKIT_ONE_LINE_ERRORS"
_exit_code: int | None = None


def install_one_line_errors() -> None:
    """In a script started by ``ddpkit launch``: a :class:`DdpkitError` that escapes the
    script is printed as one line, ``ddpkit: error: <message>`` (no traceback), and the
    process exits 2, as the CLI's own errors do. Any other exception keeps its traceback.

    The exit code is set at the very end of interpreter shutdown: torch's process group
    wraps ``sys.excepthook`` to prefix ``[rank N]`` and prints what this hook wrote only
    after it returns, and other exit handlers still run first.
    """
    import atexit

    previous = sys.excepthook

    def hook(kind, err, tb):
        global _exit_code
        if isinstance(err, DdpkitError):
            print(f"ddpkit: error: {err}", file=sys.stderr, flush=True)
            _exit_code = 2
        else:
            previous(kind, err, tb)

    sys.excepthook = hook
    atexit.register(_exit_with_code)  # registered first, so it runs last


def _exit_with_code() -> None:
    if _exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_code)
