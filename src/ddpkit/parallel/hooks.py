"""Built-in communication hooks: ``hook(state, bucket) -> Future[Tensor]``.

A hook replaces the engine's default "scale, then all-reduce the bucket" step. It gets a
:class:`~ddpkit.parallel.grad_bucket.GradBucket` and must return a future whose value is
the *averaged* flat gradient (divide by ``bucket.divisor()``). ``state`` is whatever was
passed as ``comm_state``: ``None`` (the default group), a ``ProcessGroup``, or an object
with a ``group`` attribute. The hooks follow torch's default hooks in shape and
arithmetic, so they also run under ``engine="torch"`` (torch's GradBucket has no
``divisor()``; the hooks fall back to the group size there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _group_of(state: object) -> dist.ProcessGroup | None:
    if state is None or isinstance(state, dist.ProcessGroup):
        return state
    return getattr(state, "group", None)


def _divisor(state: object, bucket) -> int:
    divisor = getattr(bucket, "divisor", None)
    if divisor is not None:
        return divisor()
    return dist.get_world_size(_group_of(state))


def _first(fut: torch.futures.Future) -> torch.Tensor:
    value = fut.value()
    return value[0] if isinstance(value, (list, tuple)) else value


def allreduce_hook(state: object, bucket) -> torch.futures.Future:
    """The backend's all-reduce (gloo, nccl), dividing before the sum like torch's hook."""
    tensor = bucket.buffer()
    tensor.div_(_divisor(state, bucket))
    work = dist.all_reduce(tensor, group=_group_of(state), async_op=True)
    return work.get_future().then(_first)


def ring_hook(state: object, bucket) -> torch.futures.Future:
    """ddpkit's own segmented ring all-reduce (``ddpkit.comm``, algo="ring")."""
    from ddpkit import comm

    tensor = bucket.buffer()
    tensor.div_(_divisor(state, bucket))
    handle = comm.all_reduce(tensor, op="sum", algo="ring", group=_group_of(state), async_op=True)

    def reduced(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()  # re-raises a failed reduction instead of handing back a half-summed bucket
        return tensor

    return handle.get_future().then(reduced)


def _compress_hook(dtype: torch.dtype):
    def hook(state: object, bucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        # Divide before compressing: the sum of W halves overflows far less often.
        compressed = buffer.to(dtype).div_(_divisor(state, bucket))
        work = dist.all_reduce(compressed, group=_group_of(state), async_op=True)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(_first(fut))
            return buffer

        return work.get_future().then(decompress)

    return hook


fp16_compress_hook = _compress_hook(torch.float16)
fp16_compress_hook.__name__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = "All-reduce the bucket in float16 (half the bytes; ~3 decimal digits)."
bf16_compress_hook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__name__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = "All-reduce the bucket in bfloat16 (half the bytes, float32's range)."


def communicator_hook(state: object, bucket) -> torch.futures.Future:
    """Reduce with a communicator object: ``state.all_reduce(tensor, op)`` (e.g. shm's).

    Runs synchronously on the autograd thread; pair it with a ``comm_state`` that has
    ``allocate`` so the bucket already lives where the communicator reduces.
    """
    tensor = bucket.buffer()
    result = state.all_reduce(tensor, "sum")
    if hasattr(result, "wait"):
        result.wait()
    tensor.div_(_divisor(state, bucket))
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


HOOKS = {
    "allreduce": allreduce_hook,
    "ring": ring_hook,
    "fp16_compress": fp16_compress_hook,
    "bf16_compress": bf16_compress_hook,
    "communicator": communicator_hook,
}
