"""``ddpkit verify``: prove that W processes train exactly like one process.

Data parallelism with a fixed global batch is, mathematically, plain SGD on that global
batch. So: take ``steps`` steps on W ranks with the chosen engine, then, on rank 0, replay
the same global batches from the same initial weights in a single process with plain
PyTorch (no engine, no collectives, mean loss over the global batch) and compare the
parameters. Rounding differs only in the order gradients are summed, so the largest
difference must stay within a tolerance that scales with the dtype's machine epsilon;
a wrong average (a sum, a missed bucket, a rank on other data) is off by orders of
magnitude more. We also check that all ranks hold identical parameters.

Dropout is switched off on both sides: its masks depend on per-process random streams,
which a single process cannot reproduce.

``--exact`` (docs/exact.md) checks exact mode, where the claim is stronger: the W ranks
end with *the same bits* as one process. The reference then runs each step's V
slices one after another in plain PyTorch, each in its own random stream (dropout
stays on), and takes the exact mean of their gradients; the tolerance is zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.data.datasets import ArrayDataset
from ddpkit.errors import ConfigError
from ddpkit.parallel.exact.reference import SliceReference
from ddpkit.runtime.launcher_link import die_with_launcher
from ddpkit.runtime.process_exit import exit_process
from ddpkit.runtime.process_group import distributed
from ddpkit.runtime.world import World
from ddpkit.train.build import Parts, Wrap, build_parts, load_data
from ddpkit.train.config import Config
from ddpkit.train.entry import run_entry
from ddpkit.train.metrics import MetricSums
from ddpkit.train.options import (
    add_resolved_config,
    add_train_options,
    add_verify_options,
    config_from_args,
)
from ddpkit.train.trainer import Trainer, slice_step, unwrap

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Rounding budget per step, in units of the dtype's epsilon x the largest weight. Summing
# gradients in another order perturbs each by a few ulps; momentum SGD carries that
# forward roughly linearly over a few steps. Measured drift here is well below 1 unit.
ULPS_PER_STEP = 64


@dataclass
class VerifyResult:
    world_size: int
    steps: int
    dtype: str
    engine: str
    max_abs_diff: float  # W ranks vs. one process
    max_rank_diff: float  # between ranks (should be exactly 0)
    tolerance: float
    max_abs_param: float
    passed: bool
    slices: int = 0  # exact mode's slices per step; 0: the default mode

    def render(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        mode = f", exact ({self.slices} slices)" if self.slices else ""
        rule = ("tolerance (exact mode: the same bits)      " if self.slices else
                f"tolerance ({ULPS_PER_STEP} eps x steps x max(1, max|param| = "
                f"{self.max_abs_param:.3g}))  ")
        return "\n".join([
            f"verify: {self.world_size} ranks vs 1 process, {self.steps} steps, "
            f"{self.dtype}, engine {self.engine}{mode}",
            f"  max |param(W ranks) - param(1 process)| = {self.max_abs_diff:.3e}",
            f"  max |param(rank r) - param(rank 0)|      = {self.max_rank_diff:.3e}",
            f"  {rule}= {self.tolerance:.3e}",
            f"  {verdict}",
        ])


def tolerance(dtype: torch.dtype, steps: int, max_abs_param: float) -> float:
    return ULPS_PER_STEP * torch.finfo(dtype).eps * steps * max(1.0, max_abs_param)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build models directly in ``dtype``: initializing in float32 and casting would give
    other initial weights than initializing in float64."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _no_dropout(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()


def _cast(datasets: tuple[ArrayDataset, ArrayDataset], dtype: torch.dtype):
    return tuple(ArrayDataset(d.x.to(dtype), d.y, d.num_classes, d.name) for d in datasets)


def reference_parts(cfg: Config, datasets: tuple[ArrayDataset, ArrayDataset],
                    threads: int) -> Parts:
    """The run's parts on one process, without an engine, on the CPU (at the thread
    count of the run being checked, which shares this process)."""
    return build_parts(cfg, World(), datasets=datasets, engine=False, threads=threads)


def reference_parameters(cfg: Config, datasets: tuple[ArrayDataset, ArrayDataset],
                         steps: int, dtype: torch.dtype, threads: int) -> list[torch.Tensor]:
    """Plain single-process SGD over the same global batches (no engine, no collectives)."""
    with default_dtype(dtype):
        parts = reference_parts(cfg, datasets, threads)
    model, opt, train_set = parts.module, parts.optimizer, parts.train_set
    model.train()
    _no_dropout(model)
    taken = 0
    while taken < steps:
        for batch in parts.sampler.batches():
            x, y = train_set.batch(batch.indices)
            opt.zero_grad(set_to_none=True)
            F.nll_loss(model(x), y).backward()
            opt.step()
            taken += 1
            if taken == steps:
                break
    return [p.detach().clone() for p in model.parameters()]


def exact_reference_parameters(cfg: Config, datasets: tuple[ArrayDataset, ArrayDataset],
                               steps: int, seed: int, threads: int) -> list[torch.Tensor]:
    """Exact mode on one process: the trainer's exact step over the one-process slices
    of :class:`~ddpkit.parallel.exact.reference.SliceReference` (no engine, no
    collectives)."""
    parts = reference_parts(cfg, datasets, threads)
    model, opt, train_set = parts.module, parts.optimizer, parts.train_set
    model.train()
    reference = SliceReference(list(model.parameters()), parts.slices, seed)
    for step in range(steps):
        batch = next(parts.sampler.batches())
        x, y = train_set.batch(batch.indices)
        real = torch.arange(len(batch.indices)) < batch.num_real
        opt.zero_grad(set_to_none=True)
        slice_step(model, reference.slices(step, x, y, real),
                   parts.slices / batch.global_num_real, parts.precision)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_plain_steps(cfg: Config) -> None:
    """verify's reference takes plain optimizer steps: refuse what it does not model."""
    o, t = cfg.optim, cfg.train
    if (o.lr_schedule, o.warmup_steps, o.clip_grad_norm, t.grad_accum, t.precision) != (
            "constant", 0, None, 1, "fp32"):
        raise ConfigError("ddpkit verify compares plain optimizer steps: leave out "
                          "--lr-schedule, --warmup-steps, --clip-grad-norm, --grad-accum "
                          "and --precision")


def verify(cfg: Config, world: World, *, steps: int = 10, dtype: str = "float32",
           wrap: Wrap | None = None) -> VerifyResult | None:
    """Run on every rank of an initialized group; rank 0 gets the result, others None."""
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_plain_steps(cfg)
    exact = cfg.train.exact
    if exact and dtype != "float32":
        raise ConfigError("ddpkit verify --exact compares float32 parameters (exact mode "
                          "sums float32, bfloat16 and float16 gradients)")
    torch_dtype = DTYPES[dtype]
    datasets = _cast(load_data(cfg.data), torch_dtype)
    with default_dtype(torch_dtype):
        trainer = Trainer(cfg, world, datasets=datasets, wrap=wrap, write=False)
    trainer.model.train()
    if not exact:  # exact mode draws dropout masks per slice: the reference can too
        _no_dropout(trainer.model)
    taken = 0
    sums = MetricSums(trainer.device)
    while taken < steps:
        for batch in trainer.sampler.batches():
            trainer.train_step(batch, sums)
            taken += 1
            if taken == steps:
                break
    if trainer.sharded:  # every rank's updated shards into the module (collective)
        trainer.model.gather_parameters()
    params = [p.detach().to("cpu", copy=True) for p in unwrap(trainer.model).parameters()]

    # Every rank compares itself with rank 0; the worst gap comes back to all.
    rank_diff = torch.zeros(1, dtype=torch.float64)
    for p in params:
        theirs = p.clone().to(trainer.device)
        dist.broadcast(theirs, src=0)
        rank_diff = torch.maximum(rank_diff, (p - theirs.cpu()).abs().max().to(torch.float64))
    dist.all_reduce(rank_diff, op=dist.ReduceOp.MAX)
    if not world.is_main:
        return None
    if exact:
        ref = exact_reference_parameters(cfg, datasets, steps, trainer.model.exact.seed,
                                         trainer.parts.threads)
    else:
        ref = reference_parameters(cfg, datasets, steps, torch_dtype, trainer.parts.threads)
    diff = max((a - b).abs().max().item() for a, b in zip(params, ref, strict=True))
    biggest = max(p.abs().max().item() for p in ref)
    tol = 0.0 if exact else tolerance(torch_dtype, steps, biggest)
    return VerifyResult(world_size=world.world_size, steps=steps, dtype=dtype,
                        engine=trainer.engine, max_abs_diff=diff,
                        max_rank_diff=rank_diff.item(), tolerance=tol, max_abs_param=biggest,
                        passed=diff <= tol and rank_diff.item() == 0.0,
                        slices=trainer.parts.slices or 0)


def run_verify_worker(cfg: Config, steps: int, dtype: str, result_file: str | None) -> int:
    with distributed() as world:
        result = verify(cfg, world, steps=steps, dtype=dtype)
    if result is None:
        return 0
    if result_file:
        Path(result_file).write_text(json.dumps(asdict(result)))
        return 0
    print(result.render(), flush=True)
    return 0 if result.passed else 1


def verify_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddpkit.train.equivalence")
    add_train_options(p)
    add_verify_options(p)
    add_resolved_config(p)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p


def run_from_args(args: argparse.Namespace) -> int:
    """The verify worker, from parsed options (``ddpkit verify`` under a launcher too)."""
    def body() -> int:
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        return run_verify_worker(config_from_args(args), args.steps, args.dtype,
                                 getattr(args, "result_file", None))

    return run_entry("verify", body)


def main(argv: list[str] | None = None) -> int:
    return run_from_args(verify_parser().parse_args(argv))


if __name__ == "__main__":
    die_with_launcher()  # a killed launcher must not leave this process running headless
    exit_process(main())
