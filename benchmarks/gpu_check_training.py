"""The GPU check's training items: DataParallel against torch DDP (bits, step times),
ZeRO against the unsharded engine, exact mode across world sizes.

Each item is ``item(setup, report, seconds_left)``; its ranks run in fresh processes
(``gpu_check_lib.run_ranks``). Runs that compare bits turn on torch's deterministic
algorithms (and the cuBLAS workspace setting they need), so that a difference is the
engines', not a kernel's run-to-run noise; every such comparison also repeats the
reference once, which says whether the kernels still differ run to run.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_lib import (  # noqa: E402
    DETERMINISTIC_ENV,
    Layout,
    Report,
    Setup,
    difference,
    interleaved,
    state_of,
    versus_rank0,
)
from gpu_check_models import Task, make_task, parameter_count  # noqa: E402

SGD_STEPS = 4


def torch_ddp(module: nn.Module, device: torch.device) -> DistributedDataParallel:
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)


def train(model: nn.Module, task: Task, world: ddpkit.World, steps: int,
          optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
    device = torch.device(world.device)
    opt = optimizer(model.parameters())
    for step in range(steps):
        x, y = task.batch(step, world.rank, world.world_size, device)
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


# ------------------------------------------------- bits: engines against a reference


@dataclass(frozen=True)
class Bits:
    """Runs from the same weights on the same batches, compared bit for bit: each of
    ``ours`` against ``reference``, which runs twice (the second run says whether the
    kernels repeat themselves)."""

    reference: str
    ours: tuple[str, ...]
    wrap: Callable[[str, nn.Module, torch.device, Setup], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    steps: str  # what the optimizer steps are, for the record


def _engines(name: str, module: nn.Module, device: torch.device, setup: Setup) -> nn.Module:
    return ddpkit.DataParallel(module) if name == "DataParallel" else torch_ddp(module, device)


def _sharded(name: str, module: nn.Module, device: torch.device, setup: Setup) -> nn.Module:
    return ddpkit.DataParallel(module, shard=name.split("=")[1].strip("'"),
                               bucket_cap_mb=setup.size(4, 0.01))


BITS = {
    "engines": Bits("torch DDP", ("DataParallel",), _engines, sgd, f"{SGD_STEPS} SGD steps"),
    "zero": Bits("shard='none'", ("shard='gradients'", "shard='parameters'"), _sharded, adamw,
                 f"{SGD_STEPS} AdamW steps"),
}
AGAIN = " run again"


def bits_rank(world: ddpkit.World, setup: Setup, keys: tuple[str, ...], kind: str) -> dict:
    """Each run of ``BITS[kind]`` on each model, and their differences (here, on the
    device): against the reference, and against rank 0's."""
    spec = BITS[kind]
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(world.device)
    out = {}
    for key in keys:
        task = make_task(key, setup)
        states, found = {}, {}
        for name in (spec.reference, *spec.ours, spec.reference + AGAIN):
            torch.manual_seed(0)
            model = spec.wrap(name.removesuffix(AGAIN), task.build().to(device), device, setup)
            train(model, task, world, SGD_STEPS, spec.optimizer)
            states[name] = state_of(model)
            found[f"comm of {name}"] = getattr(model, "comm", None)
        for name in (*spec.ours, spec.reference + AGAIN):
            found[name] = difference(states[name], states[spec.reference])
            found[f"{name} vs rank 0"] = versus_rank0(states[name])
        out[key] = found
    return out


def compare_bits(kind: str, layouts: list[Layout], setup: Setup, report: Report,
                 seconds_left: Callable[[], float]) -> None:
    spec, keys = BITS[kind], ("mlp", "gpt")
    for layout in layouts:
        results = report.run(bits_rank, layout, (setup, keys, kind), seconds_left,
                             env=DETERMINISTIC_ENV)
        for key in keys:
            name = make_task(key, setup).name
            for rank, found in enumerate(r[key] for r in results):
                for ours in spec.ours:
                    report.compare(f"{name}: {ours} vs {spec.reference} after {spec.steps}, "
                                   f"rank {rank}", layout, found[ours],
                                   control=found[spec.reference + AGAIN],
                                   control_what=spec.reference + AGAIN)
                    if rank:
                        report.compare(f"{name}: {ours}, rank {rank} vs rank 0", layout,
                                       found[f"{ours} vs rank 0"])
            comms = {k.removeprefix("comm of "): v for k, v in results[0][key].items()
                     if k.startswith("comm of ") and v is not None}
            report.facts[f"comm, {layout.label}"] = comms


def ddp_vs_torch(setup: Setup, report: Report, seconds_left: Callable[[], float]) -> None:
    compare_bits("engines", setup.native_layouts(), setup, report, seconds_left)


def zero(setup: Setup, report: Report, seconds_left: Callable[[], float]) -> None:
    compare_bits("zero", [setup.layout(1), setup.pair_layout()], setup, report, seconds_left)


# ------------------------------------------------- step times


def step_time_rank(world: ddpkit.World, setup: Setup, keys: tuple[str, ...]) -> dict:
    device = torch.device(world.device)
    out = {}
    for key in keys:
        task = make_task(key, setup)
        torch.manual_seed(0)
        base = task.build().to(device)
        models = {"no DDP": copy.deepcopy(base),
                  "DataParallel": ddpkit.DataParallel(copy.deepcopy(base)),
                  "torch DDP": torch_ddp(copy.deepcopy(base), device)}
        batches = [task.batch(s, world.rank, world.world_size, device) for s in range(2)]
        steps = {name: _stepper(model, task, batches) for name, model in models.items()}
        out[key] = interleaved(steps, device, rounds=setup.size(7, 2),
                               repeats=setup.size(10, 2), warmup=setup.size(3, 1))
    return out


def _stepper(model: nn.Module, task: Task, batches: list) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    turn = itertools.cycle(batches)

    def step() -> None:
        x, y = next(turn)
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()

    return step


def step_time(setup: Setup, report: Report, seconds_left: Callable[[], float]) -> None:
    keys = ("mlp", "gpt")
    for layout in setup.native_layouts():
        results = report.run(step_time_rank, layout, (setup, keys), seconds_left)
        for key in keys:
            task = make_task(key, setup)
            per_rank = task.global_batch // layout.world_size
            what = (f"{task.name} step ({_count(parameter_count(task))} params, batch "
                    f"{per_rank}/rank)")
            report.timing(what, layout, results[0][key], baseline="no DDP")
            ms = {row["variant"]: row["median_ms"] for row in report.timings[-3:]}
            report.facts[f"{what}, {layout.label}"] = (
                f"DataParallel {_overhead(ms['DataParallel'], ms['no DDP'])} and torch DDP "
                f"{_overhead(ms['torch DDP'], ms['no DDP'])} over no DDP; DataParallel / "
                f"torch DDP = {ms['DataParallel'] / ms['torch DDP']:.3f}")


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else str(n)


def _overhead(ms: float, base: float) -> str:
    return f"{100 * (ms / base - 1):+.1f}%"


# ------------------------------------------------- exact mode


def exact_engine(module: nn.Module, slices: int) -> nn.Module:
    """Exact mode under its decided names; with :func:`exact_slices`, the only place this
    check names exact mode's API."""
    return ddpkit.DataParallel(module, exact=True, slices=slices)


def exact_slices(model: nn.Module, *tensors: torch.Tensor):
    return model.slices(*tensors)


def exact_loss(model: nn.Module, task: Task, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step's forward and backward passes: one per slice of this rank's batch."""
    for xs, ys in exact_slices(model, x, y):
        task.loss(model, xs, ys).backward()


def exact_rank(world: ddpkit.World, setup: Setup, slice_counts: tuple[int, ...],
               timed: bool) -> dict:
    device = torch.device(world.device)
    task = make_task("dropout", setup)
    out = {}
    # The bits first: exact mode pins the numerics when its engine is built (cuBLAS's
    # workspace setting included, which must come before this process's first matrix
    # product), so this process starts with the environment a user's does.
    runs = [(f"V={v}", v) for v in slice_counts] + [(f"V={slice_counts[-1]} again",
                                                     slice_counts[-1])]
    for label, v in runs:
        torch.manual_seed(0)
        model = exact_engine(task.build().to(device), v)
        opt = sgd(model.parameters())
        for step in range(SGD_STEPS):
            x, y = task.batch(step, world.rank, world.world_size, device)
            opt.zero_grad()
            exact_loss(model, task, x, y)
            opt.step()
        out[label] = state_of(model.module, cpu=True)
    if timed:
        out["times"] = _exact_times(world, setup, device)
    return out


def _exact_times(world: ddpkit.World, setup: Setup, device: torch.device) -> dict:
    task = make_task("mlp", setup)
    torch.manual_seed(0)
    base = task.build().to(device)
    batches = [task.batch(s, world.rank, world.world_size, device) for s in range(2)]
    models = {"default": (ddpkit.DataParallel(copy.deepcopy(base)), False)}
    for v in sorted({world.world_size, 8}):
        models[f"exact V={v}"] = (exact_engine(copy.deepcopy(base), v), True)
    steps = {}
    for name, (model, exact) in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        turn = itertools.cycle(batches)

        def step(model=model, opt=opt, exact=exact, turn=turn) -> None:
            x, y = next(turn)
            # each mode with the process-wide setting it has (building an exact engine
            # turned deterministic algorithms on for everyone)
            torch.use_deterministic_algorithms(exact, warn_only=True)
            opt.zero_grad()
            if exact:
                exact_loss(model, task, x, y)
            else:
                task.loss(model, x, y).backward()
            opt.step()

        steps[name] = step
    return interleaved(steps, device, rounds=setup.size(5, 2), repeats=setup.size(8, 2),
                       warmup=setup.size(2, 1))


def exact(setup: Setup, report: Report, seconds_left: Callable[[], float]) -> None:
    pair, one = setup.pair_layout(), setup.layout(1)
    counts = (pair.world_size, 8)
    what = f"{SGD_STEPS} SGD steps with dropout"
    timed = pair.backend == setup.native  # not two ranks sharing one GPU through gloo
    alone = report.run(exact_rank, one, (setup, counts, True), seconds_left)[0]
    report.compare(f"exact V={counts[-1]}, {what}: 1 process, run again", one,
                   difference(alone[f"V={counts[-1]} again"], alone[f"V={counts[-1]}"]))
    _exact_timings(report, setup, one, alone)
    results = report.run(exact_rank, pair, (setup, counts, timed), seconds_left)
    for v in counts:
        for rank, state in enumerate(results):
            report.compare(f"exact V={v}, {what}: rank {rank} of {pair.world_size} vs 1 "
                           "process", pair, difference(state[f"V={v}"], alone[f"V={v}"]))
    if timed:
        _exact_timings(report, setup, pair, results[0])


def _exact_timings(report: Report, setup: Setup, layout: Layout, result: dict) -> None:
    task = make_task("mlp", setup)
    report.timing(f"{task.name} step, global batch {task.global_batch}", layout,
                  result["times"], baseline="default")
