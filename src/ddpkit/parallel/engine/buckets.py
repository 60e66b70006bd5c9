"""Which gradients travel together: bucket assignment and flat bucket storage.

One all-reduce per parameter pays the collective's fixed latency hundreds of times; one
all-reduce for the whole model cannot start until the last gradient exists. Buckets sit
in between: gradients are grouped in the order backward produces them, so a bucket fills
up (and its reduction can start) while autograd is still working on earlier layers.

Order: before any backward has run, the best guess for "the order gradients appear" is
the reverse of registration order (forward usually runs layers in the order they are
defined, backward runs them in reverse). After the first iteration the engine knows the
real order and re-assigns with :func:`assign_buckets` on it.

Sizes: the first bucket is small (1 MiB by default) because it holds the gradients that
are ready first; a large first bucket would make the first collective wait for many
layers. The remaining buckets are capped at ``bucket_cap_mb``. A bucket closes as soon as
adding a tensor makes it reach its limit, so one large tensor gets a bucket of its own
rather than being split (a tensor is never split across buckets).

Storage: every bucket owns one flat tensor; each parameter's gradient is a view into it
(``param.grad = view``), so the collective reduces the gradients in place and the
optimizer reads the reduced values with no copy back.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

MIB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB


def assign_buckets(
    tensors: Sequence[torch.Tensor],
    order: Sequence[int],
    limits_bytes: Sequence[int],
) -> list[list[int]]:
    """Group tensor indices into buckets, visiting ``tensors`` in ``order``.

    Tensors are grouped per (device, dtype): a flat bucket holds one dtype on one device.
    ``limits_bytes`` are the successive size limits for each group's buckets; the last
    limit repeats. Buckets are returned in the order they close, then the partly filled
    ones in the order their groups were first seen, so bucket ``i`` is expected to be
    ready no later than bucket ``i + 1``.
    """
    if not limits_bytes or any(limit <= 0 for limit in limits_bytes):
        raise ValueError(f"bucket size limits must be positive, got {list(limits_bytes)}")
    open_buckets: dict[tuple, list[int]] = {}
    open_sizes: dict[tuple, int] = {}
    limit_index: dict[tuple, int] = {}
    closed: list[list[int]] = []
    for index in order:
        tensor = tensors[index]
        key = (tensor.device, tensor.dtype)
        if key not in open_buckets:
            open_buckets[key], open_sizes[key] = [], 0
            limit_index.setdefault(key, 0)
        open_buckets[key].append(index)
        open_sizes[key] += tensor.numel() * tensor.element_size()
        if open_sizes[key] >= limits_bytes[limit_index[key]]:
            closed.append(open_buckets.pop(key))
            del open_sizes[key]
            limit_index[key] = min(limit_index[key] + 1, len(limits_bytes) - 1)
    closed.extend(open_buckets.values())  # a bucket opens with its first tensor: none is empty
    return closed


def size_limits(bucket_cap_mb: float, first_bucket_cap_mb: float | None) -> list[int]:
    """Byte limits for (first bucket, every later bucket)."""
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    cap = int(bucket_cap_mb * MIB)
    if first_bucket_cap_mb is None:
        first = min(DEFAULT_FIRST_BUCKET_BYTES, cap)
    elif first_bucket_cap_mb <= 0:
        raise ValueError(f"first_bucket_cap_mb must be positive, got {first_bucket_cap_mb}")
    else:
        first = int(first_bucket_cap_mb * MIB)
    return [first, cap] if first < cap else [cap]


Allocator = Callable[[int, torch.dtype, torch.device], torch.Tensor]


def default_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def allocator_from(comm_state: object, default: Allocator) -> Allocator:
    """Use ``comm_state.allocate`` for bucket storage when the state offers it, else
    ``default`` (the transport's).

    This is how a shared-memory communicator gets gradients written straight into its
    segment by backward: the bucket buffers *are* its memory.
    """
    allocate = getattr(comm_state, "allocate", None)
    if allocate is None or not callable(allocate):
        return default
    try:
        takes_device = len(inspect.signature(allocate).parameters) >= 3
    except (TypeError, ValueError):
        takes_device = True
    if takes_device:
        return lambda numel, dtype, device: allocate(numel, dtype, device)

    def without_device(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return default(numel, dtype, device)
        return allocate(numel, dtype)

    return without_device


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients are views into it."""

    index: int
    param_indices: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    pending: int = 0  # parameters not yet ready in the current backward
    future: torch.futures.Future | None = None
    work: object | None = None  # the backend's Work handle on the default path
    offsets: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.buffer.numel()


def build_buckets(
    params: Sequence[torch.Tensor],
    assignment: list[list[int]],
    allocate: Allocator = default_allocator,
) -> list[Bucket]:
    """Allocate one flat buffer per bucket and carve a view per parameter out of it."""
    buckets = []
    for b, indices in enumerate(assignment):
        first = params[indices[0]]
        numel = sum(params[i].numel() for i in indices)
        buffer = allocate(numel, first.dtype, first.device)
        if buffer.numel() < numel or buffer.dtype != first.dtype or buffer.device != first.device:
            raise ValueError(
                f"bucket allocator returned {buffer.numel()} x {buffer.dtype} on {buffer.device}, "
                f"need {numel} x {first.dtype} on {first.device}"
            )
        buffer = buffer.view(-1)[:numel]
        views, offsets, offset = [], [], 0
        for i in indices:
            p = params[i]
            views.append(buffer[offset : offset + p.numel()].view_as(p))
            offsets.append(offset)
            offset += p.numel()
        buckets.append(Bucket(b, list(indices), buffer, views, offsets=offsets))
    return buckets


def initial_assignment(params: Sequence[torch.Tensor], limits: Sequence[int],
                       initial_bucketing: str, *, relaid: bool = True) -> list[list[int]]:
    """Buckets before the first backward has shown the real gradient order (``relaid``:
    whether they will be laid out again by that order)."""
    if initial_bucketing == "reverse":
        return assign_buckets(params, list(reversed(range(len(params)))), limits)
    if initial_bucketing == "single" and not relaid:
        # torch's layout for good (find_unused_parameters without a static graph): buckets
        # filled in registration order under the size limits, launched last one first.
        filled = assign_buckets(params, list(range(len(params))), limits)
        return sorted(filled, key=min, reverse=True)
    if initial_bucketing == "single":
        # torch >= 2.x's choice: until the real order is known, one bucket per
        # (device, dtype) in registration order, reduced after the whole backward.
        return assign_buckets(params, list(range(len(params))), [2**62])
    raise ValueError(f"initial_bucketing must be 'reverse' or 'single', got {initial_bucketing!r}")
