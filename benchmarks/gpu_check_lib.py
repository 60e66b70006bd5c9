"""What the GPU check's items share: where ranks run, how they are started, how results
are compared, recorded and timed. (benchmarks/gpu_check.py is the command; the models
are in gpu_check_models.py.)

Ranks are fresh processes, one per rank of a :class:`Layout`, forked from
``multiprocessing``'s fork server: it is started once per item process and imports the
item's modules, torch included, without initializing CUDA, so a rank starts in a
fraction of a second instead of importing torch anew, and initializes CUDA itself. Each
rank joins its process group through ``ddpkit.distributed`` with an explicit
:class:`ddpkit.World`, so a layout may put two ranks on one GPU (gloo allows it; NCCL
does not, and ``World.from_env`` refuses more local ranks than devices). A rank writes
what it returns with ``torch.save`` to a private directory; the parent reads the files
once every rank has finished. A rank that raises or dies fails the whole layout, with
its one-line error; one that outlives the deadline is killed.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue as queue_mod
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ddpkit

# cuBLAS needs this workspace setting for deterministic results (set before its first use)
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
_PEER_GRACE_S = 5.0  # how long the other ranks may go on after one failed


class CheckFailed(Exception):
    """What an item found wrong, said in one line."""


@dataclass(frozen=True)
class Setup:
    """Where the items run: CUDA devices (the real check) or the CPU (the rehearsal, with
    gloo in place of NCCL and tiny sizes)."""

    cuda: bool
    gpus: int

    @property
    def native(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def device(self, index: int) -> str:
        return f"cuda:{index}" if self.cuda else "cpu"

    def layout(self, world_size: int) -> Layout:
        """``world_size`` ranks on the native backend, one device each."""
        return Layout(self.native, tuple(self.device(i) for i in range(world_size)))

    def native_layouts(self) -> list[Layout]:
        """One rank, and two where there are two devices (two CPU ranks in the rehearsal)."""
        sizes = [1, 2] if (self.gpus >= 2 or not self.cuda) else [1]
        return [self.layout(w) for w in sizes]

    def pair_layout(self) -> Layout:
        """Two ranks: on two GPUs with NCCL; on one GPU, both on it with gloo (NCCL refuses
        two ranks on one device)."""
        if self.cuda and self.gpus < 2:
            return Layout("gloo", (self.device(0), self.device(0)))
        return self.layout(2)

    def size(self, full: Any, tiny: Any) -> Any:
        return full if self.cuda else tiny


@dataclass(frozen=True)
class Layout:
    backend: str
    devices: tuple[str, ...]  # one per rank

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def label(self) -> str:
        shared = len(set(self.devices)) < len(self.devices) and self.devices[0] != "cpu"
        where = f"{self.devices[0]}, shared" if shared else ",".join(sorted(set(self.devices)))
        return f"{self.backend} W={self.world_size} ({where})"


def run_ranks(fn: Callable[..., Any], layout: Layout, args: tuple = (), *,
              timeout_s: float, env: dict[str, str] | None = None,
              exit_problems: list[str] | None = None) -> list[Any]:
    """``fn(world, *args)`` on every rank of ``layout``; the values by rank.

    ``fn`` must be importable by name. ``env`` is set in each rank before ``fn`` runs
    (before torch touches the device). Raises :class:`CheckFailed` naming the first rank
    that failed, or the ranks still running at ``timeout_s``. A rank that returned its
    value and then did not exit cleanly (a crash or a hang in teardown) is told to
    ``exit_problems``, and its value kept.
    """
    ctx = mp.get_context("forkserver")
    # torch.optim's first step imports torch._dynamo (a second or more): once, there
    ctx.set_forkserver_preload(["__main__", "torch._dynamo"])
    reports = ctx.Queue()
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        procs = [ctx.Process(target=_rank_main, name=f"gpu-check-rank{r}",
                             args=(fn, r, layout, args, tmp, env or {}, timeout_s, reports))
                 for r in range(layout.world_size)]
        for p in procs:
            p.start()
        try:
            error = _wait(procs, reports, deadline)
            exits = [] if error else _exits(procs)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
        if error:
            raise CheckFailed(f"{layout.label}: {error}")
        if exit_problems is not None:
            exit_problems.extend(f"{layout.label}: {problem}" for problem in exits)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(layout.world_size)]


def _wait(procs: list, reports, deadline: float) -> str | None:
    """None when every rank reported success, else what went wrong first."""
    done: set[int] = set()
    dead_since: dict[int, float] = {}
    error, give_up = None, deadline
    while len(done) < len(procs) and time.monotonic() < give_up:
        try:
            rank, message = reports.get(timeout=0.2)
        except queue_mod.Empty:
            rank, message = None, None
        if rank is not None:
            done.add(rank)
            if message and error is None:
                error, give_up = f"rank {rank}: {message}", time.monotonic() + _PEER_GRACE_S
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r in done or p.exitcode is None:
                continue
            # Dead without a report read yet: a report still in the pipe is read within
            # this second; after it, the rank died (a signal, a crash in native code).
            if now - dead_since.setdefault(r, now) > 1.0 and error is None:
                error = f"rank {r} died with exit code {p.exitcode} without reporting"
                give_up = now + _PEER_GRACE_S
    if error is None and len(done) < len(procs):
        late = [r for r in range(len(procs)) if r not in done]
        error = f"rank(s) {late} still running after the item's time limit: killed"
    return error


def _exits(procs: list) -> list[str]:
    """How the ranks that reported their values ended, where not with exit code 0."""
    problems = []
    for r, p in enumerate(procs):
        p.join(timeout=_PEER_GRACE_S * 3)
        if p.exitcode is None:
            problems.append(f"rank {r} returned its value but had not exited "
                            f"{_PEER_GRACE_S * 3:.0f} s later (killed)")
        elif p.exitcode != 0:
            problems.append(f"rank {r} returned its value, then exited with code {p.exitcode}")
    return problems


def _rank_main(fn, rank, layout, args, directory, env, timeout_s, reports) -> None:
    os.environ.update(env)
    try:
        world = ddpkit.World(rank=rank, local_rank=rank, world_size=layout.world_size,
                             local_world_size=layout.world_size,
                             devices=(layout.devices[rank],))
        store = f"file://{os.path.join(directory, 'store')}"
        with ddpkit.distributed(layout.backend, store, timeout_s, world=world):
            value = fn(world, *args)
        torch.save(value, os.path.join(directory, f"rank{rank}.pt"))
        reports.put((rank, None))
    except BaseException as exc:  # reported to the parent, which fails the layout
        traceback.print_exc()
        reports.put((rank, one_line(exc)))


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


# ----------------------------------------------------------------------- the record


@dataclass
class Report:
    """What one item found: comparisons of tensors, timings, facts, and failures."""

    comparisons: list[dict] = field(default_factory=list)
    timings: list[dict] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def compare(self, what: str, layout: Layout, found: dict[str, Any], *,
                control: dict[str, Any] | None = None,
                control_what: str = "the reference repeated") -> bool:
        """Record ``found`` (:func:`difference` of ours against the reference). A
        difference fails the item unless ``control`` (the reference computed again,
        against the reference) differs too: then the kernels themselves are not
        deterministic run to run, and that is the why."""
        row = {"what": what, "layout": layout.label, **found}
        if control is not None:
            row["control"] = {"what": control_what, **control}
        if not row["bitwise"]:
            if control is not None and not control["bitwise"]:
                row["why"] = (f"{control_what} differs from it by "
                              f"{control['max_abs_diff']:.3g}: kernels not deterministic "
                              "run to run")
            else:
                row["why"] = ("the reference repeats bitwise, so the two compute differently"
                              if control is not None else "differs")
                self.failures.append(f"{what} [{layout.label}]: max |diff| "
                                     f"{row['max_abs_diff']:.3g}, not bitwise")
        self.comparisons.append(row)
        return row["bitwise"]

    def run(self, fn: Callable[..., Any], layout: Layout, args: tuple,
            seconds_left: Callable[[], float], env: dict[str, str] | None = None) -> list:
        """:func:`run_ranks` within the item's time left; a rank that does not exit
        cleanly after returning its value fails the item (its value still counts)."""
        return run_ranks(fn, layout, args, timeout_s=seconds_left(), env=env,
                         exit_problems=self.failures)

    def require(self, condition: bool, message: str) -> None:
        if not condition:
            self.failures.append(message)

    def timing(self, what: str, layout: Layout, variants: dict[str, list[float]],
               baseline: str) -> None:
        """Medians in ms of each variant's samples (seconds), and each one's ratio to
        ``baseline``'s."""
        medians = {name: statistics.median(times) * 1e3 for name, times in variants.items()}
        base = medians[baseline]
        for name, ms in medians.items():
            self.timings.append({"what": what, "layout": layout.label, "variant": name,
                                 "median_ms": round(ms, 4), "baseline": baseline,
                                 "ratio": round(ms / base, 4) if base > 0 else None,
                                 "samples": len(variants[name])})


def difference(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, Any]:
    """Bitwise equality (``torch.equal`` on every pair) and the largest absolute
    difference, over tensors compared pairwise; a count or shape mismatch is no match."""
    if len(ours) != len(reference) or not reference:
        return {"bitwise": False, "max_abs_diff": math.inf, "tensors": len(reference),
                "elements": 0, "mismatch": f"{len(ours)} tensors against {len(reference)}"}
    worst, elements, equal = 0.0, 0, True
    for a, b in zip(ours, reference):
        if a.shape != b.shape or a.dtype != b.dtype:
            return {"bitwise": False, "max_abs_diff": math.inf, "tensors": len(reference),
                    "elements": elements, "mismatch": f"{tuple(a.shape)} {a.dtype} against "
                                                      f"{tuple(b.shape)} {b.dtype}"}
        equal = equal and torch.equal(a, b)
        elements += b.numel()
        if b.numel():
            worst = max(worst, float((a.double() - b.double()).abs().max()))
    return {"bitwise": equal, "max_abs_diff": worst, "tensors": len(reference),
            "elements": elements}


def state_of(model: nn.Module, *, cpu: bool = False) -> list[torch.Tensor]:
    """Copies of every tensor of a model's state dict (the full module's, also under
    sharding), where they are or on the CPU."""
    return [(t.detach().cpu() if cpu else t.detach()).clone()
            for t in model.state_dict().values()]


def versus_rank0(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """:func:`difference` of this rank's tensors against rank 0's (broadcast here)."""
    theirs = [t.clone() for t in tensors]
    for t in theirs:
        dist.broadcast(t, 0)
    return difference(tensors, theirs)


# ----------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(steps: dict[str, Callable[[], None]], device: torch.device, *, rounds: int,
                repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each step function, round by round in a fresh order (the same
    on every rank), the device synchronized around each call; ranks meet before each
    variant's calls."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(rounds):
        for name in random.Random(round_index).sample(names, len(names)):
            if dist.get_world_size() > 1:
                dist.barrier()
            for i in range(repeats + (warmup if round_index == 0 else 0)):
                sync(device)
                start = time.perf_counter()
                steps[name]()
                sync(device)
                if round_index > 0 or i >= warmup:
                    times[name].append(time.perf_counter() - start)
    return times
