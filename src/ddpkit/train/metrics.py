"""Exact metrics across ranks: sum counts everywhere, divide once.

Averaging per-rank averages is wrong as soon as ranks hold different numbers of real
samples (the padded last batch): a rank with 3 real samples would weigh as much as one
with 64. So every rank keeps *sums* - loss summed over samples, correct predictions,
real samples - in float64, one all_reduce adds them, and only then do we divide. Padded
samples never enter the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Totals:
    loss_sum: float = 0.0
    correct: float = 0.0
    count: float = 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else float("nan")


class MetricSums:
    """Running sums on one rank; :meth:`reduce` gives the job-wide :class:`Totals`."""

    def __init__(self, device: torch.device | str = "cpu"):
        # float64: a float32 sum of 60k per-sample losses already loses digits.
        self._sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, losses: torch.Tensor, correct: torch.Tensor) -> None:
        """``losses``: per-sample losses of real samples; ``correct``: their 0/1 hits."""
        self._sums[0] += losses.detach().sum().to(torch.float64)
        self._sums[1] += correct.detach().sum().to(torch.float64)
        self._sums[2] += losses.numel()

    def local(self) -> Totals:
        return Totals(*self._sums.tolist())

    def values(self) -> list[float]:
        """The raw sums (loss, correct, count), e.g. for a checkpoint taken mid-epoch."""
        return self._sums.tolist()

    @classmethod
    def from_values(cls, values: list[float], device: torch.device | str = "cpu") -> MetricSums:
        sums = cls(device)
        sums._sums.copy_(torch.tensor(values, dtype=torch.float64))
        return sums

    def reduce(self, group: dist.ProcessGroup | None = None) -> Totals:
        """Sum over all ranks (a collective: every rank must call it)."""
        sums = self._sums.clone()
        if dist.is_initialized():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        return Totals(*sums.tolist())


def gather_floats(value: float, device: torch.device | str = "cpu",
                  group: dist.ProcessGroup | None = None) -> list[float]:
    """One float from every rank, by rank (a collective)."""
    if not dist.is_initialized():
        return [value]
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [t.item() for t in out]
