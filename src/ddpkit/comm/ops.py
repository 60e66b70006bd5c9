"""Reduction ops by name: which dtypes each accepts and the local kernel that applies it.

Every check here is local and deterministic, so a combination we cannot reduce fails
with the same :class:`CommError` on every rank before any byte is sent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit.errors import CommError, CommValueError

OPS = ("sum", "product", "min", "max", "avg", "band", "bor", "bxor")
BITWISE_OPS = ("band", "bor", "bxor")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.int64)
# The dtypes both our ring kernels and gloo reduce; others (bool, complex, int16, fp8)
# are refused up front rather than half-supported.
DTYPES = FLOAT_DTYPES + INT_DTYPES
# Complex tensors travel as their real view (pairs of floats), as torch's collectives do:
# moved by broadcast and all_gather, summed and averaged by all_reduce. Every other op
# on them is refused, with torch's exception type (ValueError).
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def dtype_label(dtype) -> str:
    """"float32" for torch.float32; "-" for no dtype (a barrier)."""
    return "-" if dtype is None else str(dtype).removeprefix("torch.")
COMPLEX_OPS = ("sum", "avg")

_FROM_REDUCE_OP = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}

TO_REDUCE_OP = {name: op for op, name in _FROM_REDUCE_OP.items()}

# out, a, b -> out = a (op) b. `out` may alias `a`, which is how ranks reduce in place.
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]

# op -> the torch function whose out= form is its kernel (a caller on a hot path calls
# it as f(a, b, out=out) itself, saving the kernel's own call)
KERNEL_FUNCTIONS: dict[str, Callable] = {
    "sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum,
    "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor,
}
_KERNELS: dict[str, Kernel] = {
    name: (lambda out, a, b, fn=fn: fn(a, b, out=out)) for name, fn in KERNEL_FUNCTIONS.items()
}


def op_name(op: str | dist.ReduceOp) -> str:
    """Normalise ``"sum"`` / ``"SUM"`` / ``dist.ReduceOp.SUM`` to one of :data:`OPS`."""
    if isinstance(op, str):
        name = op.lower()
        if name in OPS:
            return name
    else:
        try:
            return _FROM_REDUCE_OP[op]
        except (KeyError, TypeError):
            pass
    raise CommError(f"unknown reduce op {op!r}; use one of {', '.join(OPS)}")


def check_dtype(dtype: torch.dtype, *, allow_complex: bool = False) -> None:
    if dtype in DTYPES or (allow_complex and dtype in COMPLEX_DTYPES):
        return
    names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
    if dtype in COMPLEX_DTYPES:
        raise CommError(f"dtype {dtype} is moved by broadcast/all_gather and summed by "
                        f"all_reduce only; use one of {names} here")
    raise CommError(f"dtype {dtype} is not supported by ddpkit.comm; use one of {names}")


def check_op(op: str, dtype: torch.dtype, collective: str = "reduce") -> None:
    """Refuse (op, dtype) pairs whose result would be undefined or silently wrong."""
    if dtype in COMPLEX_DTYPES and collective == "all_reduce":
        if op not in COMPLEX_OPS:
            # torch's words ("all_reduce does not support ... on complex tensors") and type
            raise CommValueError(f"all_reduce does not support {op!r} on complex tensors "
                                 f"({dtype}); use one of {', '.join(COMPLEX_OPS)}")
        return
    check_dtype(dtype)
    if op in BITWISE_OPS and dtype.is_floating_point:
        raise CommError(f"op {op!r} needs an integer tensor, got {dtype}")
    if op == "avg" and not dtype.is_floating_point:
        raise CommError(
            f"op 'avg' on {dtype} would truncate; reduce with 'sum' and divide in floating point"
        )


def kernel(op: str) -> Kernel:
    """The local reduction for ``op``; "avg" is a sum whose caller divides afterwards."""
    return _KERNELS["sum" if op == "avg" else op]


def kernel_function(op: str) -> Callable:
    """:func:`kernel`'s torch function, called as ``f(a, b, out=out)``."""
    return KERNEL_FUNCTIONS["sum" if op == "avg" else op]
