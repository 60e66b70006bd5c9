"""``DDPKIT_ENGINE=ddpkit``: torch's DDP and CPU collectives are ddpkit's in a process
however it was started (``torchrun``, ``accelerate launch``, Lightning's own spawning).

The variable is read at interpreter start by ``ddpkit-engine.pth``, a line that
installing ddpkit (also as an editable install) puts in site-packages (setup.py); the
``site`` module runs such lines in every interpreter, before the program. When the
variable is unset the line costs one dictionary lookup and imports nothing. When it is
``ddpkit``, the line imports torch and makes the swap
(:func:`ddpkit.parallel.compat.torch_swap.patch_torch`) before the program's first line, so a
framework the program imports finds ddpkit's class under torch's name whatever was
imported first. (Waiting for the program's own ``import torch`` would not do: when that
import comes from inside ddpkit, the swap, which needs ddpkit's engine, would run while
that ddpkit module is half-initialized.) ``DDPKIT_ENGINE=torch`` (what ``ddpkit launch
--engine torch`` gives its workers) leaves torch as it is. ``ddpkit launch`` runs the same
check in each worker before the program (:mod:`ddpkit.launcher.script_runner`), for an
interpreter that did not read the ``.pth`` (``python -S``, ddpkit on ``PYTHONPATH``).

This module imports torch only when the variable asks for the swap.
"""

from __future__ import annotations

import importlib
import os
import sys

ENGINE_ENV = "DDPKIT_ENGINE"
SWAP_MODULE = "ddpkit.parallel.compat.torch_swap"


def engine_from_env() -> str | None:
    """The engine ``DDPKIT_ENGINE`` asks for, or None when unset; ConfigError when it is
    neither ``ddpkit`` nor ``torch``."""
    value = os.environ.get(ENGINE_ENV)
    if value is None or value == "":
        return None
    from ddpkit.vocabulary import ENGINES

    if value not in ENGINES:
        from ddpkit.errors import ConfigError

        raise ConfigError(f"{ENGINE_ENV}={value!r} is not one of {', '.join(ENGINES)} "
                          "(ddpkit: torch's DistributedDataParallel and CPU collectives are "
                          "ddpkit's; torch: torch's own)")
    return value


def install_from_env() -> bool:
    """Swap torch's DDP and collectives for ddpkit's now (importing torch), if
    ``DDPKIT_ENGINE=ddpkit``; returns whether it did."""
    if engine_from_env() != "ddpkit":
        return False
    importlib.import_module(SWAP_MODULE).patch_torch()
    return True


def at_interpreter_start() -> None:
    """What the ``.pth`` line calls: :func:`install_from_env`, with a bad value reported
    in one line instead of site's traceback (the program then runs on torch's engine)."""
    from ddpkit.errors import ConfigError

    if _started:  # site reads a site-packages directory once per name it has (lib, lib64)
        return
    _started.append(True)
    try:
        install_from_env()
    except ConfigError as err:
        print(f"ddpkit: error: {err}", file=sys.stderr)


_started: list[bool] = []
