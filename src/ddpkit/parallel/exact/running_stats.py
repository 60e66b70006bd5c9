"""BatchNorm's running statistics in exact mode: one update per step, from every slice.

A BatchNorm layer in training normalizes with its batch's statistics and folds them
into ``running_mean``/``running_var``. Per slice, that fold would run in the order the
slices ran on each rank, so the buffers would depend on the world size. Here, during a
slice's forward the layer normalizes with the slice's statistics as usual but does not
touch its buffers (``track_running_stats`` is off for that call); its input's per-channel
mean and biased variance are kept instead, as the slice's row. After the step's last
slice every rank all-gathers the rows (a few numbers per channel per slice, every layer
in one message), so every rank holds all V in global slice order, and combines them in
float64, adding slice 0, 1, ..., V-1 in turn, into the global batch's mean and unbiased
variance: the statistics one forward of the whole global batch would fold in. Each
buffer then takes one update per step, ``running = (1 - momentum) * running + momentum
* statistic`` (``momentum=None``: the cumulative average, ``1 / num_batches_tracked``),
in float64, cast to the buffer's dtype; ``num_batches_tracked`` counts steps. The rows
have the same bits on any rank and the additions follow the slice index alone, so the
buffers have the same bits at every W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ddpkit.errors import ConfigError, DdpkitError

Gather = Callable[[torch.Tensor, torch.Tensor], object]  # (output, input), in place


def tracked_batchnorms(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The BatchNorm layers of ``module`` that keep running statistics."""
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and not isinstance(m, nn.SyncBatchNorm)]


class SliceRunningStats:
    """Keeps each slice's BatchNorm statistics and updates the buffers once a step (see
    the module docstring). ``current_slice()``: the local slice being run, None outside
    the slice loop (there a layer behaves as torch's)."""

    def __init__(self, module: nn.Module, current_slice: Callable[[], int | None]):
        self.layers = tracked_batchnorms(module)
        self._current = current_slice
        self._offsets: list[int] = []
        width = 0
        for _, m in self.layers:
            self._offsets.append(width)
            width += 2 * m.num_features + 1  # mean, variance, then the count of values
        self.width = width
        self.buffer_names = {f"{name}.{b}" if name else b for name, _ in self.layers
                             for b in ("running_mean", "running_var", "num_batches_tracked")}
        # this rank's slices' statistics, a row each (what the step's gather sends)
        self.rows = torch.zeros(0, width, dtype=torch.float64)
        self._seen = torch.zeros(0, len(self.layers), dtype=torch.bool)
        self._handles = []
        for i, (_, m) in enumerate(self.layers):
            self._handles.append(m.register_forward_pre_hook(self._before(i)))
            self._handles.append(m.register_forward_hook(self._after, always_call=True))

    def begin(self, local_slices: int, device: torch.device) -> None:
        """A step of ``local_slices`` slices begins."""
        if self.rows.shape[0] != local_slices or self.rows.device != device:
            self.rows = torch.zeros(local_slices, self.width, dtype=torch.float64,
                                     device=device)
            self._seen = torch.zeros(local_slices, len(self.layers), dtype=torch.bool)
        self._seen.zero_()

    def _before(self, index: int):
        name, layer = self.layers[index]

        def hook(module: nn.Module, args: tuple) -> None:
            m = self._current()
            if m is None or not module.training:
                return
            if self._seen[m, index]:
                raise DdpkitError(
                    f"exact mode: BatchNorm {name!r} ran twice in one slice; its running "
                    "statistics are updated once a step from each slice's one pass")
            self._seen[m, index] = True
            x = args[0].detach().float()
            dims = [0, *range(2, x.dim())]
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            c, a = layer.num_features, self._offsets[index]
            row = self.rows[m]
            row[a:a + c].copy_(mean)
            row[a + c:a + 2 * c].copy_(var)
            row[a + 2 * c] = x.numel() // c
            module.track_running_stats = False  # normalize with the slice's statistics only

        return hook

    @staticmethod
    def _after(module: nn.Module, args: tuple, output) -> None:
        module.track_running_stats = True

    def update(self, rank: int, world: int, gather: Gather | None) -> None:
        """Every slice's rows in slice order (gathered from every rank), folded into the
        buffers: one update per layer."""
        missing = [self.layers[i][0] for i in range(len(self.layers))
                   if not bool(self._seen[:, i].all())]
        if missing:
            raise DdpkitError(
                f"exact mode: BatchNorm {missing[0]!r} did not run in every slice of this "
                "rank; its running statistics need every slice's (run it in each forward, "
                "or give it track_running_stats=False)")
        local = self.rows.shape[0]
        if world > 1:
            gathered = torch.empty(world * local * self.width, dtype=torch.float64,
                                   device=self.rows.device)
            gather(gathered, self.rows.view(-1))
            # block r row m is slice r + m W: [local, W, width] is global slice order
            rows = gathered.view(world, local, self.width).transpose(0, 1).reshape(
                world * local, self.width)
        else:
            rows = self.rows
        with torch.no_grad():
            for (_, layer), a in zip(self.layers, self._offsets, strict=True):
                self._fold(layer, rows[:, a:a + 2 * layer.num_features + 1])

    @staticmethod
    def _fold(layer: nn.Module, rows: torch.Tensor) -> None:
        c = layer.num_features
        counts, means, variances = rows[:, 2 * c], rows[:, :c], rows[:, c:2 * c]
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        mean = torch.zeros(c, dtype=torch.float64, device=rows.device)
        for k in range(len(rows)):  # slice order: the same additions at every W
            total += counts[k]
            mean += counts[k] * means[k]
        mean /= total
        squares = torch.zeros(c, dtype=torch.float64, device=rows.device)
        for k in range(len(rows)):
            squares += counts[k] * (variances[k] + (means[k] - mean).square())
        unbiased = squares / (total - 1).clamp(min=1)
        if layer.num_batches_tracked is not None:
            layer.num_batches_tracked.add_(1)
        momentum = layer.momentum
        if momentum is None:  # the cumulative average over the steps
            momentum = 1.0 / float(layer.num_batches_tracked)
        for buffer, statistic in ((layer.running_mean, mean), (layer.running_var, unbiased)):
            updated = buffer.double().mul_(1.0 - momentum).add_(statistic * momentum)
            buffer.copy_(updated)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def refuse_other_running_stats(module: nn.Module, layers: Sequence[tuple[str, nn.Module]]
                               ) -> None:
    """Normalization layers exact mode refuses: SyncBatchNorm (its forward gathers the
    statistics of whatever slices the ranks run together), and InstanceNorm with
    running statistics (updated in every forward)."""
    kept = {id(m) for _, m in layers}
    stats = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
    for name, m in module.named_modules():
        if isinstance(m, nn.SyncBatchNorm):
            raise ConfigError(
                f"exact mode: SyncBatchNorm {name or '(the model)'!r} normalizes with "
                "statistics gathered from the ranks' slices, which depend on the process "
                "layout; use BatchNorm (exact mode folds its running statistics per step)")
        if isinstance(m, stats) and getattr(m, "track_running_stats", False) \
                and id(m) not in kept:
            raise ConfigError(
                f"exact mode: {type(m).__name__} {name or '(the model)'!r} updates running "
                "statistics in every forward, which per slice would depend on the process "
                "layout; use BatchNorm (exact mode folds its statistics per step), "
                "GroupNorm or LayerNorm, or track_running_stats=False")


__all__ = ["SliceRunningStats", "refuse_other_running_stats", "tracked_batchnorms"]
