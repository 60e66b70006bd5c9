"""Errors that ddpkit reports to users as one line, without a traceback."""


class DdpkitError(Exception):
    """Base for errors whose message alone tells the user what is wrong and what to do.

    The CLI prints ``ddpkit: error: <message>`` and exits with code 2 instead of a
    traceback, so messages must name the offending value and the fix.
    """


class ConfigError(DdpkitError, ValueError):
    """Bad user input: environment variables, options, configuration values."""


class CommError(DdpkitError, RuntimeError):
    """A collective that cannot run as asked (raised before any communication)."""
