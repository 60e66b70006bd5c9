"""Sparse gradients: ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)``.

A sparse gradient (row indices plus rows) cannot live in a flat dense bucket, so its
parameters stay out of the dense reducer and are reduced here, the way torch's reducer
reduces them: when the gradient is ready it is divided by the divisor in place (no comm
hook) and, at the end of backward, summed across ranks by the backend's sparse
all-reduce (gloo concatenates every rank's rows and coalesces them), one parameter at a
time in registration order. ``param.grad`` keeps its identity and holds the result,
coalesced, so the weights are bitwise torch DDP's.

The sparse all-reduces run after the dense reducer's end-of-backward work on every rank
(chained behind it when it is pending), so collectives on the group are issued in the
same order everywhere. With a comm hook, the hook gets each sparse gradient as its own
bucket (index after the dense buckets), as torch's hooks do.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import UsageError
from ddpkit.parallel.grad_bucket import GradBucket
from ddpkit.runtime.lifetime import no_python_tls


def sparse_parameters(module: nn.Module) -> set[int]:
    """ids of the parameters whose gradients are sparse (torch DDP's own test: the
    module is an Embedding or EmbeddingBag built with ``sparse=True``)."""
    found = set()
    for sub in module.modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            found.update(id(p) for p in sub.parameters(recurse=False))
    return found


class SparseReducer:
    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], group,
                 dense, first_bucket_index: int):
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.dense = dense  # the dense BucketReducer (None when every parameter is sparse)
        self.first_bucket_index = first_bucket_index
        self.comm_hook = None
        self.comm_state = None
        self.armed = False
        self.divisor = 1
        self.ready = [False] * len(self.params)
        self.callback_queued = False
        self._handles = [p.register_post_accumulate_grad_hook(partial(self._on_grad_ready, i))
                         for i, p in enumerate(self.params)]

    def arm(self, divisor: int) -> None:
        self.armed = True
        self.divisor = divisor
        self.ready = [False] * len(self.params)
        self.callback_queued = False

    def disarm(self) -> None:
        self.armed = False

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if not self.armed:
            return  # no_sync: the sparse gradient accumulates locally
        if self.ready[i]:
            raise UsageError(f"parameter {self.names[i]!r} received a gradient twice in one "
                             "backward; run one backward per forward")
        self.ready[i] = True
        if self.comm_hook is None and self.divisor != 1:
            with torch.no_grad():
                param.grad.div_(self.divisor)  # before the sum, as torch's reducer does
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        if self.dense is not None and self.dense.callback_queued:
            self.dense.after_next_backward = self._reduce  # keep the group's collective order
        else:
            self._reduce()

    def _reduce(self) -> None:
        try:
            missing = [self.names[i] for i, done in enumerate(self.ready) if not done]
            if missing:
                raise UsageError(
                    f"DataParallel: sparse-gradient parameters got no gradient in this "
                    f"backward: {', '.join(map(repr, missing))}; a sparse embedding must be "
                    "used by every rank in every synchronized backward (torch DDP has the "
                    "same rule)")
            for i, p in enumerate(self.params):
                self._reduce_one(i, p.grad)
        finally:
            self.armed = False

    def _reduce_one(self, i: int, grad: torch.Tensor) -> None:
        # At the end of backward: no autograd thread-local state into the Work (as the
        # dense reducer's launches, ddpkit.runtime.lifetime).
        with no_python_tls():
            self._reduce_now(i, grad)

    def _reduce_now(self, i: int, grad: torch.Tensor) -> None:
        if self.comm_hook is not None:
            bucket = GradBucket(self.first_bucket_index + i, grad, [self.params[i]], [grad],
                                self.divisor, i == len(self.params) - 1)
            result = self.comm_hook(self.comm_state, bucket).wait()
            if isinstance(result, (list, tuple)):
                result = result[0]
        elif dist.get_world_size(self.group) > 1:
            result = dist.all_reduce(grad, group=self.group, async_op=True).get_future().wait()[0]
        else:
            result = grad
        if result is not grad:
            with torch.no_grad():
                grad.copy_(result)

    def shadow_backward(self, divisor: int) -> None:
        """A joined rank's share of the sparse all-reduces: empty sparse gradients."""
        self.divisor = divisor
        for i, p in enumerate(self.params):
            empty = torch.sparse_coo_tensor(
                torch.empty(1, 0, dtype=torch.int64, device=p.device),
                torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device), p.shape,
                check_invariants=True)  # nothing to check in an empty tensor; says so
            self._reduce_one(i, empty)
