"""Runs tests of PyTorch's own distributed suite on our worker pools, ddpkit substituted.

The installed wheel ships torch's tests as a module,
``torch.testing._internal.distributed.distributed_test``: ``DistributedTest._DistTestBase``
holds the test methods, ``TestDistBackend`` their harness (rank, world size, a file
barrier in ``TEMP_DIR``). torch runs each test in freshly spawned processes; a process
importing that module costs seconds here, so each rank of a long-lived pool
(``tests/dist_pool.py``) imports it once and runs the named test method the way torch's
harness does in its children (the instance's rank set, torch's seed, then the method),
with ddpkit's class or functions behind torch's names for the duration of that one
test:

* ``"ddpkit"``: ``DataParallel`` as ``DistributedDataParallel``, both the module's own
  imported name and ``torch.nn.parallel.DistributedDataParallel``;
* ``"comm"``: ``ddpkit.comm.all_reduce/broadcast/reduce/barrier`` as the module's
  ``dist.*`` (the module's ``dist`` is swapped for a view of ``torch.distributed`` with
  those four replaced, so ddpkit itself still calls the real torch.distributed). torch's
  assertions on gloo's profiler events are switched off (ddpkit's paths do not call
  gloo) and replaced by a stronger one: every call is also made with torch's function on
  a copy of its input, and the results must be equal (torch's all_reduce tests check no
  values of their own);
* ``"routed"``: torch's own names, with ``ddpkit.comm.torch_route`` behind them (what
  ``ddpkit launch`` does in every worker): each call checked against torch's function as
  for ``"comm"`` (for ``all_gather``, every tensor of its output list), and counted as
  reaching ddpkit only when the route answered it (``all_gather_object``: its inner
  ``all_gather`` calls);
* ``"swapped"``: ``ddpkit.parallel.compat.torch_swap.DistributedDataParallel`` (ddpkit's engine
  that is also torch's class) behind both of torch's names, as for ``"ddpkit"``;
* ``"torch"``: nothing substituted (the baseline).

Nothing of torch's test code is copied; a torch release that changes the tests changes
what runs here.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import time
import traceback
import types
import unittest

import ddpkit
from ddpkit.parallel.compat import torch_swap

MODULE = "torch.testing._internal.distributed.distributed_test"
ENGINES = ("torch", "ddpkit", "comm", "routed", "swapped")
# How often the running test reached ddpkit (models built, collectives called): a test
# that passes without ever reaching it proves nothing, so callers check it.
_uses = [0]


class CountedDataParallel(ddpkit.DataParallel):
    """ddpkit.DataParallel, counting constructions (module level: models pickle)."""

    def __init__(self, *args, **kwargs):
        _uses[0] += 1
        super().__init__(*args, **kwargs)


class CountedSwap(torch_swap.DistributedDataParallel):
    """ddpkit's engine that is also torch's class, counting constructions."""

    def __init__(self, *args, **kwargs):
        _uses[0] += 1
        super().__init__(*args, **kwargs)


def torch_tests():
    """The module, imported in a pool worker (never in pytest's own process: it reads
    BACKEND and WORLD_SIZE at import and switches torch's global flags off)."""
    os.environ.setdefault("BACKEND", "gloo")
    return importlib.import_module(MODULE)


def _mentions(base, name: str, word: str, seen: set[str]) -> bool:
    """Whether torch's test ``name``, or a helper method it calls, mentions ``word``."""
    seen.add(name)
    source = inspect.getsource(getattr(base, name))
    if word in source:
        return True
    return any(_mentions(base, helper, word, seen)
               for helper in set(re.findall(r"self\.(_\w+)\(", source)) - seen
               if inspect.isfunction(getattr(base, helper, None)))


def test_names(prefixes=(), uses: str | None = None) -> list[str]:
    """torch's test methods whose names start with one of ``prefixes`` (all when empty)
    and, when ``uses`` is given, whose code (helpers included) mentions it."""
    base = torch_tests().DistributedTest._DistTestBase
    names = sorted(n for n in dir(base) if n.startswith("test_")
                   and (not prefixes or n.startswith(tuple(prefixes))))
    if uses is not None:
        names = [n for n in names if _mentions(base, n, uses, set())]
    return names


def census(world, prefixes, uses, skip, temp_dir: str) -> dict[str, tuple]:
    """Every test :func:`test_names` finds, except ``skip``, run with torch's own
    class and functions: which run here (and pass) and which skip."""
    names = [n for n in test_names(prefixes, uses) if n not in skip]
    return run_many(world, names, "torch", temp_dir)


_case_classes: dict = {}


def _case_class(dt):
    """torch's harness class with the test methods (what torch's own runner combines)."""
    if dt not in _case_classes:
        _case_classes[dt] = type("TorchDistTest", (dt.TestDistBackend,
                                                   dt.DistributedTest._DistTestBase), {})
    return _case_classes[dt]


class _TorchDistributed(types.ModuleType):
    """torch.distributed, with some functions replaced."""

    def __init__(self, real, overrides: dict):
        super().__init__(real.__name__)
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._real, name)


class _Checked:
    """An async handle whose wait() also compares the result with torch's."""

    def __init__(self, handle, check):
        self._handle, self._check = handle, check

    def wait(self, *args, **kwargs):
        value = self._handle.wait(*args, **kwargs)
        self._check()
        return value

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _against_torch(name: str, ours, theirs, count: bool = True):
    """``ours`` called as torch's ``theirs`` would be, and checked against it (counted as
    reaching ddpkit unless ``count`` is False: ``ours`` then counts)."""
    import torch

    signature = inspect.signature(theirs)

    def call(*args, **kwargs):
        _uses[0] += count
        bound = signature.bind(*args, **kwargs)
        # what the call writes: all_gather's list of outputs, else its one tensor
        written = "tensor_list" if name == "all_gather" else "tensor"
        tensor = bound.arguments.get(written)
        expected = None
        if isinstance(tensor, torch.Tensor) or (
                isinstance(tensor, list) and all(isinstance(t, torch.Tensor) for t in tensor)):
            copy = [t.clone() for t in tensor] if isinstance(tensor, list) else tensor.clone()
            reference = dict(bound.arguments, async_op=False, **{written: copy})
            try:
                theirs(**reference)
            except Exception as exc:  # ours must refuse it too (checked below)
                expected = exc
            else:
                expected = reference[written]
        handle = ours(*args, **kwargs)
        if isinstance(expected, Exception):
            raise AssertionError(f"torch's {name} raised {expected!r}; ddpkit's did not")

        def check():
            if expected is None:
                return
            if name == "reduce":
                group = bound.arguments.get("group")
                dst = bound.arguments.get("dst")
                if torch.distributed.get_rank() != dst or (
                        group is not None and torch.distributed.get_rank(group) < 0):
                    return  # only the destination's result is defined
            pairs = zip(tensor, expected) if isinstance(tensor, list) else [(tensor, expected)]
            for got, want in pairs:
                if not torch.equal(got, want):
                    raise AssertionError(f"ddpkit's {name} gave {got.flatten()[:8]} where "
                                         f"torch's gave {want.flatten()[:8]}")

        if handle is not None:
            return _Checked(handle, check)
        check()
        return None

    return call


def _counting_route(name: str, dispatcher):
    """torch's name with the route behind it, counting the calls ddpkit answered."""
    from ddpkit.comm import torch_route

    def call(*args, **kwargs):
        before = torch_route.counts().get(name, 0)
        try:
            return dispatcher(*args, **kwargs)
        finally:  # a call ddpkit answered with an error counts too (the timeout tests)
            _uses[0] += torch_route.counts().get(name, 0) - before

    return call


def _substitute(dt, engine: str) -> list:
    """Put ddpkit behind torch's names; returns how to undo it ((owner, name, value) to
    set back, or a function to call), last first."""
    import torch
    import torch.distributed as dist

    from ddpkit import comm

    undo = []

    def put(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if engine == "ddpkit":
        put(dt, "DistributedDataParallel", CountedDataParallel)
        put(torch.nn.parallel, "DistributedDataParallel", CountedDataParallel)
    elif engine == "comm":
        ours = {name: _against_torch(name, getattr(comm, name), getattr(dist, name))
                for name in ("all_reduce", "broadcast", "reduce")}

        def barrier(*args, **kwargs):
            _uses[0] += 1
            return comm.barrier(*args, **kwargs)

        ours["barrier"] = barrier
        put(dt, "dist", _TorchDistributed(dist, ours))
        put(dt, "PROFILING_SUPPORTED_BACKENDS", [])
        put(dt, "CUDA_PROFILING_SUPPORTED_BACKENDS", [])
    elif engine == "routed":
        from ddpkit.comm import torch_route

        torch_route.route()
        undo.append(torch_route.restore)
        ours = {name: _against_torch(name, _counting_route(name, getattr(dist, name)),
                                     torch_route.original(name), count=False)
                for name in ("all_reduce", "broadcast", "reduce", "all_gather")}
        ours["barrier"] = _counting_route("barrier", dist.barrier)
        # torch's own function, whose all_gather calls the route answers
        ours["all_gather_object"] = _counting_route("all_gather", dist.all_gather_object)
        put(dt, "dist", _TorchDistributed(dist, ours))
        put(dt, "PROFILING_SUPPORTED_BACKENDS", [])
        put(dt, "CUDA_PROFILING_SUPPORTED_BACKENDS", [])
    elif engine == "swapped":
        put(dt, "DistributedDataParallel", CountedSwap)
        put(torch.nn.parallel, "DistributedDataParallel", CountedSwap)
    elif engine != "torch":
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return undo


def run(world, name: str, engine: str, temp_dir: str) -> tuple[str, str, int]:
    """Run torch's test ``name`` on this rank: ("pass" | "skip" | "fail", detail, how
    often it reached ddpkit)."""
    outcome, detail = _run(world, name, engine, temp_dir)
    return outcome, detail, _uses[0]


def _debug_level_kept() -> list:
    """Undo steps that put back torch.distributed's debug level and its variable.

    torch's ``with_dist_debug_levels`` decorator sets TORCH_DISTRIBUTED_DEBUG and the
    level in C++ for its test, and leaves them set when the variable was unset before or
    the test raised (a skip does). Left at DETAIL, every later ``new_group`` in this
    worker wraps its gloo backend in torch's ProcessGroupWrapper, and torch's own
    DistributedDataParallel on such a group crashes the process (its logger reads the
    wrapper as a ProcessGroupGloo): the pool's later tests would die of it."""
    import torch.distributed as dist

    level, variable = dist.get_debug_level(), os.environ.get(_DEBUG_VARIABLE)

    def restore():
        if variable is None:
            os.environ.pop(_DEBUG_VARIABLE, None)
        else:
            os.environ[_DEBUG_VARIABLE] = variable
        dist.set_debug_level(level)

    return [restore]


_DEBUG_VARIABLE = "TORCH_DISTRIBUTED_DEBUG"


def _run(world, name: str, engine: str, temp_dir: str) -> tuple[str, str]:
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS

    os.environ["TEMP_DIR"] = temp_dir  # torch's file barrier (a fresh directory per test)
    os.makedirs(os.path.join(temp_dir, "barrier"), exist_ok=True)
    dt = torch_tests()
    dt.Barrier.barrier_id = 0
    case = _case_class(dt)(name)
    case.rank = world.rank
    case.file_name = os.path.join(temp_dir, "init_file")
    undo = _substitute(dt, engine) + _debug_level_kept()
    _uses[0] = 0
    started = time.perf_counter()
    try:
        common_utils.set_rng_seed()
        getattr(case, name)()
        return "pass", f"{time.perf_counter() - started:.2f} s"
    except unittest.SkipTest as exc:
        return "skip", str(exc)
    except SystemExit as exc:  # torch's GPU decorators exit with a skip code
        skips = {s.exit_code: s.message for s in TEST_SKIPS.values()}
        if exc.code in skips:
            return "skip", skips[exc.code]
        return "fail", f"exit code {exc.code}"
    except Exception:
        return "fail", traceback.format_exc()
    finally:
        for item in reversed(undo):
            if callable(item):
                item()
            else:
                setattr(*item)


def run_many(world, names: list[str], engine: str, temp_dir: str) -> dict[str, tuple]:
    """:func:`run` for several tests in turn (one pool round trip); each in its own
    barrier directory."""
    out = {}
    for i, name in enumerate(names):
        out[name] = run(world, name, engine, os.path.join(temp_dir, str(i)))
    return out


def check_passed(results: list[tuple], name: str, reached: str, ranks=None) -> None:
    """Assert :func:`run`'s per-rank results: passed everywhere, having reached ddpkit on
    ``ranks`` (default: every rank)."""
    for rank, (outcome, detail, uses) in enumerate(results):
        assert outcome == "pass", f"{name} on rank {rank} of {len(results)}: {outcome}\n{detail}"
        assert uses or (ranks is not None and rank not in ranks), (
            f"{name} passed on rank {rank} without {reached}")


def check_census(results: list[dict], selected, excluded, not_run=()) -> None:
    """Assert :func:`census`'s per-rank results: with torch's own class and functions,
    exactly ``selected`` and ``excluded`` run here (``not_run``: known to run, kept out
    of the census) and pass; every other test skipped."""
    names = set(results[0]) | set(not_run)
    expected = set(selected) | set(excluded)
    assert set(selected) <= names, sorted(set(selected) - names)
    ran = {n for n in results[0] if any(r[n][0] != "skip" for r in results)} | set(not_run)
    assert ran == expected, (f"run here but not listed: {sorted(ran - expected)}; "
                             f"listed but skipped: {sorted(expected - ran)}")
    failed = {n: r[n][:2] for r in results for n in results[0] if r[n][0] == "fail"}
    assert not failed, f"torch's own code fails: {failed}"
