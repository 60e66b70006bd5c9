"""Loaded at start-up by the plain torch programs that tests run as references (their
PYTHONPATH names this directory): ddpkit's teardown at interpreter exit, for them too.

torch alone can abort at exit after a program that succeeded: a gloo thread frees a
collective's Python objects after the interpreter began finalizing ("terminate called
without an active exception"; ddpkit/runtime/lifetime.py, benchmarks/clean_exit.py measures how
often). A reference run that aborted after writing its results would fail a test for a
defect that is torch's, and a test must not retry it. The program itself runs
unchanged: this only registers ddpkit's teardown first, so it runs after the program's
own atexit handlers, in processes that used torch.distributed.
"""

import atexit
import sys


def _teardown() -> None:
    if "torch.distributed" in sys.modules:
        from ddpkit.runtime import lifetime

        lifetime.exit_teardown(destroy_default=True)


atexit.register(_teardown)
