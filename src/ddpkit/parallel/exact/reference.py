"""Exact mode's step on one process, without the engine: the reference that ``ddpkit
verify --exact`` holds a run against.

A step's V slices run one after another on the whole global batch (slice ``k`` holds
its positions ``k, k + V, ...``), each in its own random stream; each slice's gradients
are kept, and after the last the exact mean of the V is put in ``.grad``. The slices,
their random streams and the mean are exact mode's own (``slices``, ``exact_sum32``),
so a run at any world size must end with the same bits as this.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ddpkit.parallel.exact.exact_sum32 import choose_format, make_mean
from ddpkit.parallel.exact.slices import slice_rng


class SliceReference:
    """``for xs, ys, ... in reference.slices(step, x, y, ...)``: forward and backward
    once per slice; when the loop ends, the parameters' ``.grad`` hold the exact mean."""

    def __init__(self, params: Sequence[torch.Tensor], slices: int, seed: int):
        self.params = [p for p in params if p.requires_grad]
        self.v, self.seed = slices, seed
        numel = sum(p.numel() for p in self.params)
        self.rows = torch.empty(slices, numel)
        self.mean = make_mean(choose_format(slices, numel=numel), slices, numel, slices)
        self.result = torch.empty(numel)

    def slices(self, step: int, *tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
        for k in range(self.v):
            with slice_rng(self.seed, step, k):
                yield tuple(t[k::self.v].contiguous() for t in tensors)
            torch.cat([p.grad.reshape(-1) for p in self.params], out=self.rows[k])
            for p in self.params:
                p.grad = None
        self.mean.mean(self.rows, self.result)
        sizes = [p.numel() for p in self.params]
        for p, g in zip(self.params, self.result.split(sizes), strict=True):
            p.grad = g.view_as(p)
