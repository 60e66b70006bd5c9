"""The training recipe around the step: the names a config may give, the learning-rate
schedule, the precision, how many micro-batches per optimizer step and whether gradients
are clipped. The trainer calls these per step; each is a plain function or a small
object, so an own training loop can use them too. (What is built once, from model and
data to optimizer, is :mod:`ddpkit.train.build`'s.)

* ``--model package.module:factory`` / ``--data package.module:factory``: the user's
  own ``nn.Module`` and data set, found and called by the helpers here
  (:func:`load_factory`, :func:`call_with`);
* ``--lr-schedule constant|cosine`` with ``--warmup-steps`` (:func:`lr_at`): a pure
  function of the optimizer step, so the step counter in a checkpoint *is* the schedule's
  state and a resumed run follows the same learning rates bit for bit;
* ``--precision fp32|bf16|fp16`` (:class:`Precision`): autocast; fp16 adds a GradScaler
  (CUDA only), whose state is checkpointed;
* ``--grad-accum N`` (:func:`accumulation_groups`) and ``--clip-grad-norm X``.

Nothing here imports torch at module level: the launching ``ddpkit train`` reads the
names and checks the specs without it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ddpkit.errors import ConfigError
from ddpkit.vocabulary import PRECISIONS, SCHEDULES

if TYPE_CHECKING:
    import torch

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


# --------------------------------------------------------------------------- user factories
def is_factory(name: str) -> bool:
    """``package.module:attribute``: a user's factory rather than a built-in name."""
    return bool(_SPEC.match(name))


def short_name(name: str) -> str:
    """For run directory names: ``pkg.mod:make_net`` -> ``make_net``."""
    return name.rpartition(":")[2].rpartition(".")[2] if is_factory(name) else name


def check_factory_spec(name: str, flag: str, builtins: Iterable[str]) -> None:
    """A name that is neither built in nor a well-formed factory spec (no import)."""
    if name in builtins or is_factory(name):
        return
    raise ConfigError(f"{flag} {name!r} is not one of {', '.join(builtins)}, nor "
                      "package.module:factory (a function in your own module)")


def find_factory_module(name: str, flag: str) -> None:
    """Without importing it: is the factory's module there? (``ddpkit train`` checks this
    before starting any process; importing it would import torch in the launcher.)"""
    module = name.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as err:
        raise ConfigError(f"{flag} {name}: cannot find module {module} ({err})") from None
    if not found:
        raise ConfigError(f"{flag} {name}: no module {module} on the Python path (run from "
                          "its directory or install it; PYTHONPATH reaches the workers)")


def load_factory(name: str, flag: str) -> Callable[..., Any]:
    """The callable ``package.module:attr`` names; one-line ConfigErrors otherwise."""
    module_name, _, attr = name.partition(":")
    find_factory_module(name, flag)
    module = importlib.import_module(module_name)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{flag} {name}: module {module_name} has no {attr}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{flag} {name}: {attr} is not callable (a function or class "
                          "returning the object)")
    return target


def call_with(factory: Callable[..., Any], offered: dict[str, Any], what: str) -> Any:
    """Call ``factory`` with those of ``offered`` its signature names (all, given **kw)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins have no signature: offer nothing
        return factory()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return factory(**offered)
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in offered]
    if required:
        raise ConfigError(f"{what} needs {', '.join(required)}, which ddpkit does not pass; "
                          f"it may take any of: {', '.join(offered)}")
    return factory(**{k: v for k, v in offered.items() if k in params})


# --------------------------------------------------------------------------- learning rate
def lr_at(step: int, base_lr: float, schedule: str, warmup_steps: int,
          total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based: the step about to be taken).

    Warm-up rises linearly to ``base_lr`` over the first ``warmup_steps`` steps (step 0
    at ``base_lr / warmup_steps``); then ``constant`` stays, ``cosine`` falls as half a
    cosine to 0 at ``total_steps``.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    return SCHEDULES.resolve(schedule, "--lr-schedule")(base_lr, step, warmup_steps, total_steps)


def constant_lr(base_lr: float, step: int, warmup_steps: int, total_steps: int) -> float:
    return base_lr


def cosine_lr(base_lr: float, step: int, warmup_steps: int, total_steps: int) -> float:
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def steps_per_epoch(num_samples: int, batch_size: int, grad_accum: int,
                    drop_last: bool = False) -> int:
    """Optimizer steps in an epoch: its global batches (the last one partial unless
    ``drop_last``) in groups of ``grad_accum``."""
    batches = num_samples // batch_size if drop_last else math.ceil(num_samples / batch_size)
    return math.ceil(batches / grad_accum)


# --------------------------------------------------------------------------- accumulation
def accumulation_groups(batches: Iterable[Any], n: int) -> Iterator[list[Any]]:
    """Consecutive groups of ``n`` batches (fewer at an epoch's end): one optimizer step
    each. A sampler that advances as it yields has, after a group, the position of the
    optimizer step that group makes."""
    it = iter(batches)
    while True:
        group = []
        for batch in it:
            group.append(batch)
            if len(group) == n:
                break
        if not group:
            return
        yield group


def no_sync(model, last: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce for every micro-batch but a step's last."""
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


# --------------------------------------------------------------------------- precision
class Precision:
    """Forward under autocast (bf16 or fp16), backward through a GradScaler for fp16.

    ``fp32``: nothing. ``bf16``: autocast on the device; bf16 has fp32's range, so no
    scaler. ``fp16``: autocast plus :class:`torch.amp.GradScaler`, CUDA only. Use::

        with precision.autocast():
            loss = ...
        precision.backward(loss)
        ... (more micro-batches)
        norm = precision.step(optimizer, params, clip=1.0)
    """

    def __init__(self, name: str, device: torch.device):
        import torch

        dtype = PRECISIONS.resolve(name, "--precision")
        if name == "fp16" and device.type != "cuda":
            raise ConfigError(f"--precision fp16 needs CUDA (its GradScaler); this rank runs "
                              f"on {device.type}: use --precision bf16")
        self.name, self.device = name, device
        self.dtype = None if dtype == torch.float32 else dtype  # None: no autocast
        self.scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        import torch

        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def full(self, out: torch.Tensor) -> torch.Tensor:
        """An autocast output back in float32 for the loss; other dtypes as they are."""
        return out.float() if self.dtype is not None and out.dtype == self.dtype else out

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
             clip: float | None = None, clip_with: Callable | None = None
             ) -> torch.Tensor | None:
        """Unscale, clip to ``clip`` (total 2-norm over ``params``, or ``clip_with(clip)``:
        a sharded model's own, over every rank's shards), step; returns the norm before
        clipping (None without clipping)."""
        import torch

        norm = None
        if clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            norm = (clip_with(clip) if clip_with is not None
                    else torch.nn.utils.clip_grad_norm_(params, clip))
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


__all__ = ["Precision", "accumulation_groups",
           "call_with", "check_factory_spec", "find_factory_module",
           "is_factory", "load_factory", "lr_at", "no_sync", "set_lr",
           "short_name", "steps_per_epoch"]
