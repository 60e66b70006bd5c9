"""A run whose loss or weights stop being finite ends, with its last good checkpoint kept.

A learning rate too high for the model (or an overflow in low precision) turns the loss
into inf or NaN, and from the next optimizer step on every weight is NaN: training on
would only write NaN checkpoints over the good ones and report NaN accuracy as a
result. The trainer checks where every rank already holds the same numbers, so all
ranks stop at the same point without a collective of their own:

* before every checkpoint: every rank's running loss sums (gathered for the checkpoint
  anyway) and the weights (equal on every rank after a data-parallel step);
* at every epoch's end: the reduced train and test loss.

The process then exits with :data:`EXIT_DIVERGED`; a restart would only repeat the
same steps, so the launcher does not restart it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ddpkit.errors import DdpkitError


class DivergedError(DdpkitError):
    """The training loss or the weights are no longer finite."""


def first_bad(values: Sequence[float]) -> float | None:
    """The first non-finite value of ``values``, or None."""
    return next((v for v in values if not math.isfinite(v)), None)


def weights_finite(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter is finite (one device sync, however many tensors)."""
    flags = [torch.isfinite(p.detach()).all() for p in parameters]
    return bool(torch.stack(flags).all()) if flags else True


def diverged(what: str, step: int, epoch: int, last_good: str | None, lr: float) -> DivergedError:
    """The one line a diverged run ends with: what went bad where, what was kept, what to do."""
    kept = (f"the last good checkpoint, {last_good}, is kept" if last_good else
            "no checkpoint was written with it")
    return DivergedError(
        f"{what} at step {step} (epoch {epoch}): the run diverged and was stopped before "
        f"saving; {kept}; start again with a lower --lr (it is {lr:g}) or with "
        "--clip-grad-norm")
