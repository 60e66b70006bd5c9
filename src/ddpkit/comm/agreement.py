"""Make every rank fail together, before any payload moves, when a call cannot run.

Why this exists: when ranks disagree on a collective's size, gloo does not raise. A
receive that gets more bytes than it posted aborts the whole process (``terminate
called after throwing gloo::EnforceNotMet``), and a broadcast of mismatched sizes
"succeeds" with garbage. A rank that refuses a call locally (bad dtype, bad root)
while its peers go ahead leaves them waiting until the group's timeout.

Every call therefore carries a signature: a row of eight integers
(collective, algorithm, op, dtype, sizes, root, and whether this rank found a problem,
see :class:`CallSignature`). Identical rows mean every rank validated the same arguments
the same way; anything else becomes the same :class:`CommError` on every rank
(:func:`verdict`). How the rows travel depends on the algorithm:

* **in-band** where the algorithm synchronises anyway: the shm engine publishes its
  signature word at the barrier each call starts with (``ddpkit.comm.shm``), always on;
  a registered in-band algorithm may exchange rows itself and judge them with
  :func:`verdict` (through the signature object's ``row()`` and ``verdict(rows)``);
* otherwise (the backend, the ring, hierarchical across hosts, registered algorithms
  without ``in_band``) by :func:`agree`: one tiny all-gather before the call (one backend
  round trip), which ``check=False`` skips for callers that guarantee agreement. The
  ring does not carry the row in a header of its own: on gloo that is not reliably
  cheaper than this all-gather (docs/collectives.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ddpkit.comm.backend import agree_all_gather
from ddpkit.errors import CommError

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "barrier")


def code(text: str) -> int:
    """A stable small integer for a name (every rank computes the same one)."""
    return zlib.crc32(text.encode())


@dataclass(frozen=True)
class CallSignature:
    collective: str
    algo: str
    op: str  # "-" for collectives without one
    dtype: str
    numel_in: int
    numel_out: int
    root: int  # -1 when the collective has no root
    problem: bool  # this rank refused the call locally

    def row(self) -> list[int]:
        return [
            COLLECTIVES.index(self.collective),
            code(self.algo),
            code(self.op),
            code(self.dtype),
            self.numel_in,
            self.numel_out,
            self.root,
            int(self.problem),
        ]

    def describe(self) -> str:
        size = f"{self.numel_in}" if self.numel_in == self.numel_out else (
            f"{self.numel_in}->{self.numel_out}"
        )
        parts = [f"{size} x {self.dtype}", f"algo={self.algo}"]
        if self.op != "-":
            parts.append(f"op={self.op}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        return ", ".join(parts)


def _decode(row: list[int], names: Iterable[str], dtypes: Iterable[str], ops: Iterable[str]):
    def lookup(value: int, choices: Iterable[str]) -> str:
        return next((c for c in choices if code(c) == value), f"<unknown {value:#x}>")

    return CallSignature(
        collective=COLLECTIVES[row[0]] if 0 <= row[0] < len(COLLECTIVES) else "?",
        algo=lookup(row[1], names),
        op=lookup(row[2], ops),
        dtype=lookup(row[3], dtypes),
        numel_in=row[4],
        numel_out=row[5],
        root=row[6],
        problem=bool(row[7]),
    )


def agree(
    mine: CallSignature,
    group,
    group_size: int,
    device: torch.device,
    *,
    known_algos: Iterable[str],
    known_ops: Iterable[str],
    known_dtypes: Iterable[str],
) -> None:
    """All-gather the signatures, then :func:`verdict` on them."""
    if group_size == 1:
        return
    row = torch.tensor(mine.row(), dtype=torch.int64, device=device)
    table = torch.empty(group_size * row.numel(), dtype=torch.int64, device=device)
    agree_all_gather(table, row, group)
    verdict(mine, table.view(group_size, -1).tolist(), known_algos=known_algos,
            known_ops=known_ops, known_dtypes=known_dtypes)


def verdict(
    mine: CallSignature,
    rows: list[list[int]],
    *,
    known_algos: Iterable[str],
    known_ops: Iterable[str],
    known_dtypes: Iterable[str],
) -> None:
    """Given every group rank's row (in group-rank order), raise the same CommError on
    every rank unless all are equal and no rank refused. A rank's own refusal is raised
    by the caller, not here: it knows the more specific reason."""
    refused = [r for r, values in enumerate(rows) if values[-1]]
    if mine.problem:
        return
    if refused:
        who = ", ".join(str(r) for r in refused)
        raise CommError(
            f"{mine.collective}: group rank(s) {who} refused the call (see their error); "
            "every rank of the group must pass arguments the call accepts"
        )
    if any(values != rows[0] for values in rows):
        names, dtypes, ops = list(known_algos), list(known_dtypes), list(known_ops)
        calls = [_decode(v, names, dtypes, ops) for v in rows]
        # name the collective per rank only where ranks called different ones
        named = len({c.collective for c in calls}) > 1
        lines = "; ".join(
            f"rank {r}: {c.collective + ' ' if named else ''}{c.describe()}"
            for r, c in enumerate(calls)
        )
        raise CommError(
            f"{mine.collective} arguments differ across ranks ({lines}); every rank of the "
            "group must pass the same size, dtype, op, root and algorithm"
        )
