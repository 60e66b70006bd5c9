"""Exact mode of :class:`ddpkit.DataParallel`: the same bits at any world size.

``DataParallel(model, exact=True, slices=V)`` trains so that W ranks end with
the parameters one process would, bit for bit, for every W dividing V. A step is V
*slices* of the global batch (:mod:`ddpkit.parallel.exact.slices`); a
rank runs the V/W it owns one after another::

    for xs, ys in model.slices(x, y):          # x, y: this rank's local batch
        F.cross_entropy(model(xs), ys).backward()
    optimizer.step()                           # .grad: the exact mean over all V slices

Each slice's forward and backward see the same inputs (the same contiguous shapes),
the same random numbers (torch's generators seeded from (seed, step, slice)) and the
same intra-op thread count wherever they run, so each slice's gradient has the same
bits on any rank. When the slice's backward ends, its gradients are kept for the sum
(large ones as autograd left them, small ones copied together) and ``param.grad``
goes back to None, so the next slice's backward starts clean.
When the last local slice's backward ends, the kept gradients are summed in the run's
format (:func:`ddpkit.parallel.exact.exact_sum32.make_mean`: an associative fixed-point
sum with one MAX and one SUM all-reduce, or on small models the gather format's one
all-gather and additions in slice order; the collectives run by
:mod:`ddpkit.parallel.exact.exact_transport`) and ``.grad`` holds the mean over the V
slices: the sum does not depend on which rank held which slice, so neither do the bits.

What exact mode refuses (one line each): comm hooks, ``no_sync()`` (accumulation is
more slices), ``ddpkit.join`` (slices are equal by construction), layers that update
buffers in forward other than BatchNorm (whose running statistics are folded once a step
from every slice's, :mod:`ddpkit.parallel.exact.running_stats`; a buffer changed any
other way during a step is an error at its end),
parameters on several devices, float64 parameters (a fixed point of at most 53 bits would round
them more than float64 summation does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import ConfigError, DdpkitError
from ddpkit.log import get_logger
from ddpkit.parallel.engine.interfaces import CommHook
from ddpkit.parallel.exact.exact_sum32 import FORMATS, choose_format, make_mean
from ddpkit.parallel.exact.exact_transport import ExactTransport, agreed_settings
from ddpkit.parallel.exact.kept_grads import KeptGradients
from ddpkit.parallel.exact.running_stats import (
    SliceRunningStats,
    refuse_other_running_stats,
    tracked_batchnorms,
)
from ddpkit.parallel.exact.slices import (
    caller_streams,
    owned_slices,
    pin_numerics,
    seed_slice,
    slice_positions,
)
from ddpkit.runtime.lifetime import no_python_tls
from ddpkit.slice_count import EXACT_THREADS, check_slices, saved_slice_count

log = get_logger(__name__)

EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NO_JOIN = ("exact mode does not join uneven inputs (ddpkit.join, torch's Join): every rank "
           "runs the same slices, padded to equal size")


def check_module(module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]]) -> None:
    """What exact mode refuses about a model, in one line each, before any communication:
    parameters on several devices, dtypes its sum would round more than float
    summation does, and layers other than BatchNorm that update running statistics in
    every forward (per slice, they would fold them in an order that depends on the
    layout)."""
    devices = sorted({str(p.device) for _, p in named_params})
    if len(devices) > 1:
        raise ConfigError(f"exact mode keeps one device's parameters; this model's are "
                          f"on {', '.join(devices)}")
    for n, p in named_params:
        if p.dtype not in EXACT_DTYPES:
            raise ConfigError(
                f"exact mode sums float32, bfloat16 and float16 gradients; parameter "
                f"{n!r} is {p.dtype} (its fixed-point sum, at most 53 bits, would round float64 "
                "more than float64 summation does)")
    refuse_other_running_stats(module, tracked_batchnorms(module))


class ExactReducer:
    """DataParallel's reducer in exact mode (see the module docstring); implements
    :class:`ddpkit.parallel.engine.interfaces.Reducer` on an
    :class:`~ddpkit.parallel.exact.exact_transport.ExactTransport`.

    The engine's forward arms it (:meth:`arm`), and :meth:`slices` is
    ``DataParallel.slices``. ``step`` counts the reductions done (the slice streams'
    step); with ``slice_count`` and ``seed`` it is the state a checkpoint keeps
    (:meth:`state_dict`). The model was checked by :func:`check_module`.
    """

    def __init__(self, module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]],
                 group, transport: ExactTransport, *, slices: int | None,
                 find_unused_parameters: bool, seed: int | None = None):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.device = self.params[0].device
        self._devices = [self.device]
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.transport = transport
        self.find_unused = find_unused_parameters
        self.slice_count: int | None = None
        # the sum's format ("int32", "float64"): fixed with V (the default depends on
        # it and on the element count), or by a checkpoint (a run keeps its format)
        self.sum_format: str | None = None
        self._format_saved = False  # set by a checkpoint: kept whatever V is set after
        self.seed, self._requested_format = agreed_settings(
            transport, self.world_size, self.device, seed)
        self._offsets: list[int] = []
        total = 0
        for p in self.params:
            self._offsets.append(total)
            total += p.numel()
        self.numel = total  # before V: the default format depends on both
        if slices is not None:
            self.set_slice_count(slices)
        self.step = 0
        # BatchNorm's running statistics: folded once a step, from every slice's
        self._running = (SliceRunningStats(module, lambda: self._local)
                         if tracked_batchnorms(module) else None)
        folded = self._running.buffer_names if self._running else set()
        self._buffers = [(n, b) for n, b in module.named_buffers() if n not in folded]
        self._kept = KeptGradients(self.params, self.device)  # the step's terms
        self._local_slices = 0
        # in the shared segment on one host: the int32 sum's ranks each decode a share
        # of the mean into every rank's copy
        self._result = transport.allocate(total, torch.float32, self.device)
        self._grad_views: list[torch.Tensor] | None = None  # per parameter, of _result
        self._float32 = all(p.dtype == torch.float32 for p in self.params)  # no casts
        self._mean: Any = None  # ExactMean32, ExactMean or ExactMeanGather, by the format
        self._local: int | None = None  # the local slice being run, inside slices()
        self._done = 0  # local slices of this step whose backward has ended
        self.armed = False
        self._captured: list[bool] = []  # per local slice: its backward has been taken
        self._used = [False] * len(self.params)
        self._callback_queued = False
        self._versions: list[int] = []
        if torch.get_num_threads() != EXACT_THREADS:
            log.info(f"exact mode: {EXACT_THREADS} intra-op thread per process (was "
                     f"{torch.get_num_threads()}); results then do not depend on the cores "
                     "a rank has. torch.set_num_threads(N) afterwards trades that for "
                     "speed: every run that must match then needs the same N")
        pin_numerics(EXACT_THREADS, cuda=self.device.type == "cuda")
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, p in enumerate(self.params)]

    # -- settings and state --------------------------------------------------------------

    def set_slice_count(self, slices: int) -> None:
        """Fix V (before the first step; ``ddpkit.Run(exact=True)`` sets it from its
        sampler when the engine was built without it)."""
        v = check_slices(slices, None, self.world_size)
        if self.slice_count not in (None, v) and self.step:
            raise ConfigError(f"exact mode: this run has {self.slice_count} slices; "
                              f"they cannot change to {v} in the middle of it")
        self.slice_count = v
        if not self._format_saved:
            self.sum_format = choose_format(v, self._requested_format, numel=self.numel)

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the slice count (it must not change), the step of the
        slice streams and their seed, and the sum's format (it must not change)."""
        return {"slices": int(self.slice_count or 0), "step": self.step,
                "seed": self.seed, "sum_format": self.sum_format or ""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = saved_slice_count(state)
        # Checkpoints from before the int32 format summed in float64.
        sum_format = state.get("sum_format") or "float64"
        if sum_format not in FORMATS:
            raise ConfigError(f"exact mode: this checkpoint's sum format {sum_format!r} is "
                              f"unknown here (one of {', '.join(FORMATS)}); resume it with "
                              "the ddpkit version that wrote it")
        if sum_format != self.sum_format:
            if self.sum_format is not None:
                log.info(f"exact mode: continuing with the checkpoint's {sum_format} sum "
                         f"(this run chose {self.sum_format}): the same bits as if "
                         "uninterrupted")
            self.sum_format = sum_format
            self._mean = None  # rebuilt in that format at the next step
        self._format_saved = True
        if self.slice_count is None:
            self.set_slice_count(saved)
        self.step = int(state["step"])
        self.seed = int(state["seed"])

    # -- the slice loop ------------------------------------------------------------------

    def slices(self, tensors: Sequence[torch.Tensor]) -> Iterator[Any]:
        """This rank's slices of its local batch (each tensor cut alike along dim 0),
        each yielded inside its own random stream; see DataParallel.slices."""
        v = self.slice_count
        if v is None:
            raise ConfigError(
                "exact mode needs the number of slices: DataParallel(model, "
                "exact=True, slices=V), or ddpkit.Run(..., exact=True), which takes "
                "it from the sampler")
        if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() for t in tensors):
            raise ConfigError("model.slices(...) takes this rank's batch tensors (samples "
                              "along dim 0), e.g. model.slices(x, y)")
        lengths = {t.shape[0] for t in tensors}  # (len() of a tensor runs Python code)
        if len(lengths) != 1:
            raise ConfigError(f"model.slices(...): the tensors hold {sorted(lengths)} samples; "
                              "give the same batch's tensors")
        parts = slice_positions(lengths.pop(), v, self.world_size)
        owned = owned_slices(self.rank, self.world_size, v)
        whole = len(parts) == 1  # one slice per rank: the whole local batch, no view to cut
        self._begin_step(len(parts))
        finished = False
        step = self.step  # (the last slice's backward counts the step done)
        try:
            with caller_streams(self._devices) as generators:
                for m, (part, k) in enumerate(zip(parts, owned, strict=True)):
                    # Contiguous copies: a strided view's layout (its stride is V/W rows)
                    # could steer a kernel to another code path at another world size.
                    pieces = [(t if whole else t[part]).contiguous() for t in tensors]
                    seed_slice(generators, self.seed, step, k)
                    self._local = m
                    yield pieces[0] if len(pieces) == 1 else tuple(pieces)
                    self._local = None
                    self._check_ran(m, len(parts))
            finished = True
        finally:
            self._local = None
            self.armed = False
            if not finished:
                self._done = 0
                self._kept.clear()

    def _check_ran(self, m: int, local_slices: int) -> None:
        if self._done != m + 1:
            raise DdpkitError(
                f"exact mode: slice {m + 1} of {local_slices} on this rank ran no "
                "backward through the model; each slice needs one forward and one "
                "backward (loss.backward()) inside the loop")

    def _begin_step(self, local_slices: int) -> None:
        leftover = [self.names[i] for i, p in enumerate(self.params) if p.grad is not None]
        if leftover:
            raise ConfigError(
                f"exact mode: {leftover[0]!r} still has a gradient when a step's slices begin; "
                "call optimizer.zero_grad() (set_to_none=True, its default) before each step "
                "(exact mode accumulates across slices, not across steps)")
        if self._mean is None or self._local_slices != local_slices:
            # the gather format adds rows in slice order: every gradient is copied into
            # its slice's row of the buffer the gather sends (one segment, all packed)
            gather = self.sum_format in ("gather", "fold")
            sizes = self._kept.plan(one_segment=gather)
            self._mean = make_mean(self.sum_format, local_slices, self.numel,
                                   self.slice_count,
                                   extra=len(self.params) if self.find_unused else 0,
                                   device=self.device, allocate=self.transport.allocate,
                                   segments=sizes)
            self._kept.pack(local_slices, self._mean.rows_view if gather else None)
            self._local_slices = local_slices
        self._kept.begin()
        if self._running is not None:
            self._running.begin(local_slices, self.device)
        self._done = 0
        self._used = [False] * len(self.params)
        self._captured = [False] * local_slices
        self._versions = [b._version for _, b in self._buffers]

    # -- the engine's reducer interface --------------------------------------------------

    def arm(self, divisor: int) -> None:
        if self._local is None:
            raise ConfigError(
                "exact mode: run each training forward/backward inside the slice loop: "
                "for xs, ys in model.slices(x, y): model(xs) ... .backward()")
        stray = next((n for n, p in zip(self.names, self.params) if p.grad is not None), None)
        if stray is not None:
            raise DdpkitError(
                f"exact mode: {stray!r} has a gradient that no slice's backward through the "
                "model left (a second backward in a slice, or one outside model.slices()); "
                "run one backward per slice")
        self.armed = True

    def disarm(self) -> None:
        if self._local is not None and torch.is_grad_enabled():
            raise ConfigError("exact mode has no no_sync(): gradient accumulation is more "
                              "slices per step (slices=)")
        self.armed = False

    def maybe_rebuild(self, src: int) -> None:
        """Nothing to lay out again: the sum's segments follow the parameters."""

    def bucket_names(self) -> list[list[str]]:
        """One reduction unit: every parameter, summed together after the last slice."""
        return [list(self.names)]

    def bucket_sizes(self) -> list[int]:
        return [sum(p.numel() for p in self.params)]

    def set_comm_hook(self, hook: CommHook, state: object) -> None:
        raise ConfigError("exact mode sums gradients itself; comm hooks do not apply")

    def set_static_graph(self) -> None:
        """Nothing to do: every slice's backward already checks which parameters got no
        gradient, and there are no buckets to lay out again."""

    def shadow_backward(self, divisor: int) -> None:
        raise ConfigError(NO_JOIN)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._running is not None:
            self._running.remove_hooks()

    # -- one slice's backward ------------------------------------------------------------

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            # Only to get the end-of-backward callback queued (that needs a running
            # backward); the callback moves every gradient at once.
            if self.armed and not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(
                    self._end_of_backward)

        return hook

    def _end_of_backward(self) -> None:
        """A slice's backward is over: its gradients are kept, ``.grad`` goes to None."""
        self._callback_queued = False
        self.armed = False
        m = self._local
        if self._captured[m]:
            raise DdpkitError("exact mode: a second backward in one slice; run one backward "
                              "per slice (sum the losses first)")
        self._captured[m] = True
        grads = [p.grad for p in self.params]
        missing = [i for i, g in enumerate(grads) if g is None]
        if missing and not self.find_unused:
            names = ", ".join(repr(self.names[i]) for i in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise DdpkitError(
                f"DataParallel: parameters got no gradient in this slice's backward: {names}"
                f"{more}. Pass find_unused_parameters=True if the graph skips them on "
                "purpose, or make sure the loss depends on every parameter")
        sparse = next((i for i, g in enumerate(grads) if g is not None and g.is_sparse), None)
        if sparse is not None:
            raise DdpkitError(f"parameter {self.names[sparse]!r} has a sparse gradient; exact "
                              "mode sums dense gradients (nn.Embedding(sparse=False))")
        self._kept.keep(m, grads)
        if self.find_unused:
            for i, g in enumerate(grads):
                if g is not None:
                    self._used[i] = True
        for p in self.params:
            p.grad = None  # the next slice's backward writes a fresh gradient
        self._done += 1
        if self._done == self._local_slices:
            self._reduce()

    def _reduce(self) -> None:
        # Which parameters some slice on some rank used travels with the sum; without
        # find_unused_parameters every slice used every one (it was checked).
        used = (torch.tensor(self._used, dtype=torch.float32, device=self.device)
                if self.find_unused else None)
        collectives = {}  # none on one process
        if self.world_size > 1 and self.sum_format in ("gather", "fold"):
            # on one host: read the peers' messages in place
            collectives = {"all_gather": self.transport.gather_, "shared": self.transport}
        elif self.world_size > 1:
            collectives = {"all_reduce_max": self.transport.max_,
                           "all_reduce_sum": self.transport.sum_}
            if self.sum_format == "int32":  # on one host: read the peers' rows in place
                collectives["shared"] = self.transport
        # Inside backward (this is its end callback): collectives must not capture
        # autograd's Python thread-local state (see ddpkit.runtime.lifetime). A sum on one
        # process, or one that reads its peers in place, launches none: it skips the
        # guard's cost.
        quiet = not collectives or (getattr(self._mean, "in_place", False)
                                    and self._running is None)
        try:
            with contextlib.nullcontext() if quiet else no_python_tls():
                self._mean.mean(self._kept.terms, self._result, extra_max=used,
                                **collectives)
                if self._running is not None:
                    self._running.update(self.rank, self.world_size, self.transport.gather_)
        finally:
            self._kept.clear()
        # (no torch.no_grad() needed: the result does not require a gradient)
        if self._grad_views is None:  # the same views of the result every step
            self._grad_views = [
                self._result[start:start + p.numel()].view_as(p)
                for p, start in zip(self.params, self._offsets, strict=True)]
        if used is None and self._float32:  # every parameter, its view as it is
            for p, view in zip(self.params, self._grad_views):
                p.grad = view
        else:
            flags = used.tolist() if used is not None else [True] * len(self.params)
            for p, view, anywhere in zip(self.params, self._grad_views, flags, strict=True):
                if not anywhere:
                    p.grad = None  # unused on every rank, like torch DDP: optimizers skip it
                    continue
                p.grad = view if p.dtype == view.dtype else view.to(p.dtype)
        self.step += 1
        changed = [name for (name, b), before in zip(self._buffers, self._versions)
                   if b._version != before]
        if changed:
            raise DdpkitError(
                f"exact mode: buffer {changed[0]!r} changed during the step; per slice its "
                "value would depend on the process layout (a layer that updates state in "
                "forward: make it stateless, or update it outside the slice loop)")


__all__ = ["EXACT_DTYPES", "NO_JOIN", "ExactReducer", "check_module"]
