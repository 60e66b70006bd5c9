"""Subcommands of the ``ddpkit`` CLI, one module each (see ddpkit.cli)."""
