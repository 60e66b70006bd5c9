"""How ``ddpkit launch`` runs a user's program on each rank: exactly as ``python script.py``
(or ``python -m module``) would, plus one thing at the end.

``python -m ddpkit.launcher.script_runner script.py ARGS...`` (or ``-m module ARGS...``) runs the
program as ``__main__`` with the same ``sys.argv``, ``sys.path[0]``, ``__file__``, exit
code and traceback. When the program is over, after its own ``atexit`` handlers, the
runner frees what the program left in its module globals (a torch DDP model holds its
process group), then the default process group is destroyed after the ranks meet
(:mod:`ddpkit.runtime.lifetime`). The groups' gloo threads are therefore joined before the
interpreter finalizes, where a thread still freeing a collective's Python objects would
otherwise abort the process ("terminate called without an active exception") although
the program succeeded. The program's own code is not touched; with
``DDPKIT_ENGINE=ddpkit`` (``ddpkit launch``'s default) torch's DistributedDataParallel and
CPU collectives are ddpkit's before its first line (:mod:`ddpkit.launcher.engine_choice`).
"""

from __future__ import annotations

import atexit
import gc
import importlib.machinery
import io
import os
import runpy
import sys
import types

from ddpkit.launcher import engine_choice
from ddpkit.runtime import lifetime

USAGE = "usage: python -m ddpkit.launcher.script_runner (SCRIPT | -m MODULE) [ARGS...]"

_programs: list[dict] = []  # the globals of the program this process runs


def _new_main(path: str | None) -> types.ModuleType:
    """A fresh ``__main__`` module, as the interpreter makes for a script (the runner's
    own module stays out of the program's way)."""
    module = types.ModuleType("__main__")
    if path is not None:
        module.__file__ = path
        module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    module.__cached__ = None
    sys.modules["__main__"] = module
    _programs.append(module.__dict__)
    return module


def run_path(path: str, args: list[str]) -> None:
    """Run the script at ``path`` as ``python path args`` would."""
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isfile(path):  # a directory or zip with __main__.py
        _programs.append(runpy.run_path(path, run_name="__main__"))
        return
    module = _new_main(path)
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, module.__dict__)


def run_module(name: str, args: list[str]) -> None:
    """Run module ``name`` as ``python -m name args`` would."""
    sys.argv = [name, *args]
    _new_main(None)
    # The interpreter's own implementation of ``-m``: runs in ``sys.modules["__main__"]``,
    # the fresh module made above, and sets argv[0] to the module's file.
    runpy._run_module_as_main(name, alter_argv=True)


def _clear_globals(namespace: dict) -> None:
    """What finalization does to a module's dict, done now: names with one leading
    underscore first, then the others, set to None (``__builtins__`` kept), so a
    ``__del__`` that runs meanwhile still finds the names it uses."""
    names = [n for n in namespace if n != "__builtins__"]
    for first in (True, False):
        for name in names:
            if (name.startswith("_") and not name.startswith("__")) == first:
                namespace[name] = None


def free_program() -> None:
    """Drop what the finished program still holds, so the objects it kept in globals (and
    any cycles among them) are freed now rather than during finalization."""
    # An uncaught exception's traceback holds the program's frames and so its globals;
    # the exception itself stays (ddpkit.runtime.lifetime reads it to skip the exit barrier).
    failed = getattr(sys, "last_value", None)
    if isinstance(failed, BaseException):
        failed.__traceback__ = None
    sys.last_traceback = None
    while _programs:
        _clear_globals(_programs.pop())
    gc.collect()


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    lifetime.destroy_default_group_at_exit()
    engine_choice.install_from_env()  # DDPKIT_ENGINE=ddpkit: torch's DDP is ddpkit's
    # Registered before the program runs, so it runs after the program's own handlers
    # and before ddpkit.runtime.lifetime's teardown (atexit runs handlers last-in, first-out).
    atexit.register(free_program)
    try:
        if argv[0] == "-m":
            run_module(argv[1], argv[2:])
        else:
            run_path(argv[0], argv[1:])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        report_uncaught(exc)
        raise SystemExit(1) from None


def report_uncaught(exc: BaseException) -> None:
    """What the interpreter does with an exception that reached the top, with the
    traceback starting at the program's first frame (not the runner's)."""
    tb = exc.__traceback__
    while tb is not None and _is_runner_frame(tb.tb_frame):
        tb = tb.tb_next
    exc = exc.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    sys.excepthook(type(exc), exc, tb)
    record_for_the_agent(exc)


def record_for_the_agent(exc: BaseException) -> None:
    """What torchrun's ``@record`` does, for every program: the exception goes to the
    rank's error file, so the launcher's summary can tell a rank that raised from the
    peers that then lost it ("Connection closed by peer"), although torchrun's clock ties
    them to the second."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(exc)


def _is_runner_frame(frame) -> bool:
    name = frame.f_code.co_filename
    return name == __file__ or name.endswith("runpy.py") or name == "<frozen runpy>"


if __name__ == "__main__":
    main(sys.argv[1:])
