"""The signature word of a shared-memory call: one int64 the ranks compare.

Each rank publishes its call's word in the control block at the call's first barrier:
bit 0 "this rank refused", then op, dtype, collective and root. Ranks whose words
differ made different calls, and :func:`describe_call` turns every rank's word back
into words for the error they all raise.
"""

from __future__ import annotations

from ddpkit.comm import ops

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "barrier")
_NONE = 15  # op "-" (no op), or a dtype shm cannot name


_DTYPE_NAMES = tuple(ops.dtype_label(d) for d in ops.DTYPES)


def signature_word(collective: str, dtype: str, op: str, root: int = -1,
                   problem: bool = False) -> int:
    """The word for a call; ``dtype`` and ``op`` by name ("-" when there is none)."""
    d = _DTYPE_NAMES.index(dtype) if dtype in _DTYPE_NAMES else _NONE
    o = ops.OPS.index(op) if op in ops.OPS else _NONE
    root = root if isinstance(root, int) and root >= -1 else -2
    return int(problem) | o << 1 | d << 5 | COLLECTIVES.index(collective) << 9 | (root + 2) << 13


def describe_call(numel: int, word: int) -> tuple[str, str]:
    """(collective, "numel x dtype, op=..., root=...") for a published word."""
    o, d, c, root = word >> 1 & 15, word >> 5 & 15, word >> 9 & 15, (word >> 13) - 2
    collective = COLLECTIVES[c] if c < len(COLLECTIVES) else f"<collective {c}>"
    parts = [f"{numel} x {_DTYPE_NAMES[d] if d < len(_DTYPE_NAMES) else 'other dtype'}"]
    if o < len(ops.OPS):
        parts.append(f"op={ops.OPS[o]}")
    if root >= 0:
        parts.append(f"root={root}")
    if collective != "all_reduce":
        parts.insert(0, collective)
    return collective, ", ".join(parts)
