"""What a communication hook sees: one bucket of gradients (mirrors torch's GradBucket)."""

from __future__ import annotations

import torch


class GradBucket:
    """A bucket handed to ``comm_hook(state, bucket)``.

    ``buffer()`` is the flat gradient tensor: the parameters' ``.grad`` are views into it,
    so a hook that reduces it in place and returns a future of it costs no copy. A hook
    may also return a future of another tensor of the same numel (any floating dtype); the
    engine copies it in.
    ``divisor()`` is the number the summed gradients must be divided by to get the
    average this iteration: the world size, or the number of ranks still training under
    :func:`ddpkit.join` with ``divide_by_initial_world_size=False``.
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        divisor: int,
        is_last: bool,
    ):
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._gradients = gradients
        self._divisor = divisor
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """What ``buffer()`` returns from now on (torch's semantics: the gradients are
        untouched; what reaches them is the value of the future the hook returns). torch's
        ``fp16_compress_wrapper`` relies on it: it swaps in a half-precision copy, and the
        wrapped hook then reduces that."""
        self._buffer = tensor

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._gradients)

    def divisor(self) -> int:
        return self._divisor

    def is_last(self) -> bool:
        return self._is_last

    def __repr__(self) -> str:
        return (f"GradBucket(index={self._index}, numel={self._buffer.numel()}, "
                f"dtype={self._buffer.dtype}, params={len(self._parameters)})")
