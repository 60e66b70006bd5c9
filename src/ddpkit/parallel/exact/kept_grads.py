"""Exact mode's kept gradients: each slice's gradients held until the step's sum.

When a slice's backward ends, ``param.grad`` goes back to None (the next slice's
backward writes fresh gradients), and the slice's gradients become terms of the sum,
per *segment* of the parameters:

* a large gradient (:data:`KEEP_ELEMENTS` elements or more) is kept as autograd left
  it: a flat view, no copy (a list of the local slices' ones);
* a run of consecutive smaller ones is copied (one ``_foreach_copy_``) into that
  slice's row of a ``[V/W, size]`` buffer, so the sum works on a few long segments and
  takes a stacked segment's rows in single ops (a missing term is zeros).

The "gather" format (:mod:`ddpkit.parallel.exact.exact_gather`) adds rows in slice
order, so there every parameter is one segment, copied into the rows the gather sends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddpkit.parallel.exact.exact_sum import PIECE_ELEMENTS

# A gradient at least this long is summed where autograd left it; shorter ones are
# copied together (a copy of a short gradient costs less than the sum's per-op
# overhead on it).
KEEP_ELEMENTS = PIECE_ELEMENTS


class KeptGradients:
    """The terms of a step's sum, per segment (see the module docstring).

    :meth:`plan` lays out the segments (once per format), :meth:`pack` makes the
    buffers for a count of local slices, :meth:`begin` starts a step, :meth:`keep`
    takes a slice's gradients, ``terms`` is what the sum reads, :meth:`clear` lets
    the kept gradients go."""

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device):
        self.params = list(params)
        self.device = device
        self.segments: list[list[int]] = []  # parameter indices per segment
        self._packs: list = []  # per segment: (buffer, views per local slice) or None
        self.terms: list = []  # per segment: list of 1-D gradients, or the stacked buffer

    def plan(self, one_segment: bool) -> list[int]:
        """Lay out the segments (all parameters in one: ``one_segment``); their sizes."""
        sizes = [p.numel() for p in self.params]
        self.segments = [list(range(len(sizes)))] if one_segment else _segments(sizes)
        return [sum(sizes[i] for i in run) for run in self.segments]

    def pack(self, local_slices: int, rows: torch.Tensor | None = None) -> None:
        """Buffers for ``local_slices`` slices: ``rows`` (``[local_slices, n]``) holds
        every parameter when the plan is one segment; else new buffers for the runs of
        small gradients."""
        if rows is not None:
            self._packs = [self._pack(self.segments[0], local_slices, rows)]
            return
        self._packs = [self._pack(run, local_slices)
                       if self.params[run[0]].numel() < KEEP_ELEMENTS else None
                       for run in self.segments]

    def begin(self) -> None:
        self.terms = [[] if pack is None else pack[0] for pack in self._packs]

    def clear(self) -> None:
        """The kept gradients go back to the allocator."""
        self.terms = [[] for _ in self.segments]

    def _pack(self, run: list[int], local_slices: int, stacked: torch.Tensor | None = None):
        """A ``[local_slices, size]`` buffer for a run of gradients (``stacked``, else a
        new one), and per row its view per parameter."""
        if stacked is None:
            stacked = torch.empty(local_slices, sum(self.params[i].numel() for i in run),
                                  dtype=torch.float32, device=self.device)
        views = []
        for m in range(local_slices):
            mine, offset = [], 0
            for i in run:
                size = self.params[i].numel()
                mine.append(stacked[m, offset:offset + size].view_as(self.params[i]))
                offset += size
            views.append(mine)
        return stacked, views

    def keep(self, m: int, grads: list[torch.Tensor | None]) -> None:
        """Local slice ``m``'s gradients into the step's terms: a large one kept as it
        is, the others copied into row ``m`` of their run's buffer (zeros if unused)."""
        for j, (run, pack) in enumerate(zip(self.segments, self._packs, strict=True)):
            if pack is None:
                g = grads[run[0]]
                if g is not None:
                    self.terms[j].append(_flat_float32(g))
                continue
            views = pack[1][m]
            mine = [grads[i] for i in run]
            if all(g is not None for g in mine):  # (not "None in": that runs Tensor.__eq__)
                torch._foreach_copy_(views, mine)  # one call for the run
                continue
            for view, g in zip(views, mine, strict=True):
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)


def _segments(sizes: Sequence[int]) -> list[list[int]]:
    """Parameter indices per segment of the sum, in order: a large parameter alone, a
    run of consecutive small ones together."""
    segments: list[list[int]] = []
    for i, size in enumerate(sizes):
        if size >= KEEP_ELEMENTS:
            segments.append([i])
        elif segments and sizes[segments[-1][-1]] < KEEP_ELEMENTS:
            segments[-1].append(i)
        else:
            segments.append([i])
    return segments


def _flat_float32(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as the sum reads it: float32, its elements in the parameter's logical
    order (a copy only for another dtype or a non-contiguous layout)."""
    if grad.dtype != torch.float32:
        grad = grad.float()
    return grad.reshape(-1)


__all__ = ["KEEP_ELEMENTS", "KeptGradients"]
