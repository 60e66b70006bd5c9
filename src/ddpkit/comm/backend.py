"""``algo="backend"``: torch.distributed's own collectives behind ddpkit.comm's signatures.

This is the baseline every other algorithm is measured and tested against, and the
fallback "auto" picks when no specialised algorithm claims a tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm import ops

# The flat-tensor collectives have new names in torch_target.TORCH_CHECKED; older releases
# (>= 2.6) have only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class BackendAlgorithm:
    """Each call maps onto one torch.distributed collective (async when asked)."""

    def __repr__(self) -> str:
        return "BackendAlgorithm()"

    @staticmethod
    def _op(op: str) -> dist.ReduceOp:
        return ops.TO_REDUCE_OP[op]

    def all_reduce(self, tensor: torch.Tensor, op: str, group=None, async_op: bool = False):
        return dist.all_reduce(tensor, self._op(op), group=group, async_op=async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group=None,
        async_op: bool = False,
    ):
        return _reduce_scatter_flat(output, input, self._op(op), group=group, async_op=async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False
    ):
        return _all_gather_flat(output, input, group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
        return dist.broadcast(tensor, src, group=group, async_op=async_op)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: str, group=None, async_op: bool = False
    ):
        return dist.reduce(tensor, dst, self._op(op), group=group, async_op=async_op)

    def barrier(self, group=None, async_op: bool = False):
        return dist.barrier(group=group, async_op=async_op)


def agree_all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """The flat all-gather the agreement check uses (sync, on ``group``)."""
    _all_gather_flat(output, input, group=group)
