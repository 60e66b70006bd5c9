"""The "gather" and "fold" formats of exact mode's sum: every slice's gradient on every
rank (or partial sums of them), added in an order fixed by the slice index.

The "int32" and "float64" formats (:mod:`ddpkit.parallel.exact.exact_sum32`,
:mod:`ddpkit.parallel.exact.exact_sum`) make the sum independent of its grouping by
rounding every term onto an agreed grid: two all-reduces (the grid, then the
integers) and three passes over the terms. On a small model those are a fixed cost of
several Python-level calls and two collective latencies per step, larger than the
arithmetic. This format instead moves the terms themselves:

1. every rank's V/W local float32 rows (a row per slice: that slice's gradient) are
   all-gathered, so every rank holds all V rows (one collective, V·n·4 bytes); on one
   host (shared memory) each rank copies them into the segment instead, and after one
   barrier every rank reads every rank's rows where they lie;
2. every rank converts them to float64 (exact) in *global slice order* 0, 1, ..., V-1
   and adds them in a fixed pairwise tree over that order (slices 2i and 2i + 1, then
   pairs of those sums, an odd last one carried up a level): the same float64
   additions whatever the world size (the rows are the same bits at every W, see
   :mod:`ddpkit.parallel.exact.slices`), a handful of whole-row operations;
3. the sum is divided by V in float64 (one rounding; exact for a power of two) and
   cast to float32.

Rank r's local row m is global slice ``r + m·W`` (:func:`owned_slices`), so after a
gather in rank order slice k sits in block ``k % W``, row ``k // W``. At W = 1 nothing
is gathered and the same additions run on the local rows.

Accuracy: a float32 term is exact in float64, and each term passes through at most
``L = ceil(log2 V)`` additions that round at ``2^-53`` of their result, so with ``g``
the true mean, per element (to first order) ``|r - g| <= u |g| + 2^-53 |g| +
L 2^-53 sum_k |g_k| / V`` (u = 2^-24: the cast; the division; the additions). Float32
summation then division is bounded by ``u |g| + (V - 1) u sum_k |g_k| / V``; since
``L <= V - 1`` the additions' part is at least 2^29 times smaller here, and ``2^-53 |g|
<= 2^-53 sum_k |g_k| / V``, so the bound holds for every V >= 2 (V = 1: the term
itself): no V is too large for the arithmetic. The cost grows with V·n (every rank
receives and adds every row), so exact mode picks this format by default only where
V·n is small (:func:`ddpkit.parallel.exact.exact_sum32.choose_format`). Non-finite
terms come out as float64 addition in that fixed tree makes them (inf, or NaN), the
same on every rank and world size.

The **"fold"** format (now the default wherever "gather" was) adds in another
fixed tree over the slice index, chosen so that a rank can add its own slices before
the gather: at each level of ``count`` nodes, node ``k`` gets node ``k + ceil(count/2)``
added (:func:`fold_levels`: the range folded in halves; the same depth, ``L``, so the
same bound). Rank r owns the slices ``k = r (mod W)``, and while W divides the half,
both nodes of every pair are the same rank's: those levels run on each rank's own rows
(V = 8, W = 2: two of three levels; W = 1: all), and the gather moves one float64 node
per remaining local pair instead of every float32 row (V = 8, W = 2: 8 bytes an element
per rank instead of 16), and each rank adds only the levels left (here one). Where
W does not divide the first half (V = 12, W = 4; V = W), nothing is added before the
gather and the float32 rows travel as in "gather". The tree is a function of V alone,
so the bits are the same at every W, whichever levels ran before the gather. It is
another format, not a new order for "gather": a checkpoint records the format, and a
run that began with "gather" keeps its tree (the same bits as uninterrupted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ddpkit.parallel.exact.exact_sum import Column, checked_segments, columns_of

Gather = Callable[[torch.Tensor, torch.Tensor], object]  # (output, input), in place


def fold_levels(terms: int) -> list[tuple[int, int]]:
    """The "fold" format's tree over ``terms`` slices, level by level: ``(count, half)``
    with ``half = ceil(count / 2)``; at a level node ``k < count - half`` becomes node
    ``k`` + node ``k + half`` (an odd count's middle node ``half - 1`` is carried), and
    ``half`` nodes go on to the next level."""
    levels = []
    count = terms
    while count > 1:
        half = (count + 1) // 2
        levels.append((count, half))
        count = half
    return levels


def _fold_(nodes: torch.Tensor, count: int, half: int) -> None:
    """One level of the fold tree, in place on ``nodes`` (``[>= count, n]``, float64)."""
    nodes[: count - half].add_(nodes[half:count])


class ExactMeanGather:
    """The "gather" and "fold" formats of :class:`~ddpkit.parallel.exact.exact_sum.ExactMean`:
    the same constructor and ``mean``, with ``all_gather(output, input)`` (rank order, in
    place; None: this process holds every row) in place of the two all-reduces.

    ``rows_view``: the ``[rows, n]`` float32 rows of this rank's slices; a caller that
    copies each slice's gradient straight into its row passes ``rows_view`` itself as
    the slots, and nothing more is copied before the sum. ``rows`` must divide
    ``terms`` (every rank holds V/W rows). ``fold``: the "fold" format (see the module
    docstring), else "gather"."""

    def __init__(self, rows: int, n: int, terms: int, *, extra: int = 0,
                 device: torch.device | str = "cpu", allocate=None,
                 segments: Sequence[int] | None = None, fold: bool = False):
        self.segments = checked_segments(rows, n, terms, segments)
        if rows < 1 or terms % rows:
            raise ValueError(f"the gather sum needs the same row count on every rank: "
                             f"{rows} rows of {terms} terms")
        self.rows, self.n, self.terms, self.extra = rows, n, terms, extra
        self.format = "fold" if fold else "gather"
        self.world = world = terms // rows
        self._local_levels: list[tuple[int, int]] = []  # in local nodes
        self._shared_levels: list[tuple[int, int]] = []  # in global nodes, after the gather
        nodes = rows  # per rank, sent
        if fold:
            levels = fold_levels(terms)
            # a level is this rank's own while its pairs k, k + half are both its own
            # (k mod W alike): while W divides half
            local = next((i for i, (_, half) in enumerate(levels) if half % world),
                         len(levels))
            self._local_levels = [(c // world, h // world) for c, h in levels[:local]]
            self._shared_levels = levels[local:]
            if local:
                nodes = levels[local][0] // world if local < len(levels) else 1
        wide = bool(self._local_levels)  # the message is float64 nodes, not float32 rows
        dtype = torch.float64 if wide else torch.float32
        width = nodes * n + extra  # one rank's message: its rows or nodes, then extras
        self.nodes, self.width = nodes, width
        self._local = torch.zeros(max(width, rows * n), dtype=dtype, device=device)
        self._message = self._local[:width]
        # Where ``allocate`` puts them in the host's shared segment, the peers read each
        # rank's message there in place instead of gathering it: two copies of it, used
        # in turn, so one barrier a step suffices (a rank writes a copy again two steps
        # later, past the next step's barrier, which every peer reaches after reading).
        self._exchange: list[torch.Tensor] = []
        if world > 1 and allocate is not None and torch.device(device).type == "cpu":
            self._exchange = [allocate(width, dtype, device) for _ in range(2)]
        self._peers: list[list[torch.Tensor]] | None | bool = False  # False: not looked up
        self._turn = 0  # which copy this step's message goes to
        if wide:
            # the rows apart; folded in place in the message's buffer (exact: float32 in
            # float64), whose first nodes are sent, the extras after them
            self.rows_view = torch.zeros(rows, n, dtype=torch.float32, device=device)
            self._folded = self._local[: rows * n].view(rows, n)
        else:
            self.rows_view = self._local[: rows * n].view(rows, n)
        self._extras_out = self._message[nodes * n:]
        blocks = self._message.view(1, width)
        self._gathered = None
        if world > 1:
            self._gathered = torch.empty(world * width, dtype=dtype, device=device)
            blocks = self._gathered.view(world, width)
        self._extras_in = blocks[:, nodes * n:]
        # global node k = m W + r is block r's node m: [nodes, W, n] in global order
        self._in_order = blocks[:, : nodes * n].view(world, nodes, n).transpose(0, 1)
        count = nodes * world
        self._rows64 = torch.empty(count, n, dtype=torch.float64, device=device)
        self._rows64_in = self._rows64.view(nodes, world, n)
        self._half = None if fold else torch.empty((count + 1) // 2, n, dtype=torch.float64,
                                                   device=device)
        # the mean: x / V, one rounding in float64 (exact scaling when V is a power of
        # two: then a product with 1 / V, the same exact result), then the cast; any
        # other divisor a tensor, so that no kernel (CUDA's) turns a scalar division
        # into a rounded reciprocal's product
        self._divisor = torch.tensor(float(terms), dtype=torch.float64, device=device)
        self._inverse = 1.0 / terms if terms & (terms - 1) == 0 else None

    def mean(self, slots: torch.Tensor | Sequence[Column], out: torch.Tensor, *,
             all_gather: Gather | None = None, extra_max: torch.Tensor | None = None,
             shared=None, **_unused) -> torch.Tensor:
        """``out`` (any float dtype, n elements) = the mean over all terms.

        ``extra_max``: ``extra`` values (per-parameter "used" flags) whose maximum over
        the ranks it holds afterwards (they travel in the same gather). ``shared``: an
        :class:`~ddpkit.parallel.exact.exact_transport.ExactTransport` whose segment may
        hold every rank's message (where ``allocate`` put it there): then each is read
        where it lies, after one barrier, instead of all-gathered."""
        self._fill(slots)
        if self._local_levels:
            self.fold_local()
        if self.world == 1:
            return self.add(out)
        if self.extra:
            self._extras_out.copy_(extra_max.reshape(-1))
        peers = self._peer_messages(shared)
        if peers is not None:
            turn, self._turn = self._turn, 1 - self._turn
            self._exchange[turn].copy_(self._message)
            shared.barrier()  # every rank's message of this step is written
            messages = peers[turn]
            if self.extra:
                tails = torch.stack([message[self.nodes * self.n:] for message in messages])
                extra_max.copy_(tails.amax(0).view_as(extra_max))
            return self.add(out, messages)
        if all_gather is None:
            raise ValueError(f"{self.rows} local rows of {self.terms} terms need all_gather")
        all_gather(self._gathered, self._message)
        if self.extra:
            extra_max.copy_(self._extras_in.amax(0).view_as(extra_max))
        return self.add(out)

    def _peer_messages(self, shared) -> list[list[torch.Tensor]] | None:
        """Per copy of the message, every rank's, readable in place, in rank order; None
        where ``shared`` does not hold them all (looked up once, at the first sum: a
        collective, every rank together)."""
        if self._peers is False:
            found = None
            if shared is not None and self._exchange:
                found = shared.peer_views(self._exchange)
            self._peers = found
        return self._peers

    @property
    def in_place(self) -> bool:
        """Whether the sum reads the peers' messages in place (it launches no collective;
        known after the first sum)."""
        return bool(self._peers)

    def fold_local(self) -> None:
        """The fold tree's levels whose pairs are both this rank's, on its own rows."""
        self._folded.copy_(self.rows_view)  # float32 -> float64: exact
        for count, half in self._local_levels:
            _fold_(self._folded, count, half)

    def add(self, out: torch.Tensor, messages: Sequence[torch.Tensor] | None = None
            ) -> torch.Tensor:
        """``out`` = the mean of every rank's rows (or nodes): in float64, in a fixed tree
        over the global slice index. ``messages``: every rank's message, in rank order
        (read in place); None: those the gather left (this rank's own at W = 1)."""
        rows, n = self._rows64, self.n
        levels = self._shared_levels
        if self.format == "fold" and levels and self.nodes == 1:
            # one node per rank, global node k is rank k's: the first level converts
            # node k to float64 (exact) and adds node k + half to it as it reads it
            count, half = levels[0]
            nodes = self._in_order[0] if messages is None else messages
            for k in range(half):
                rows[k].copy_(nodes[k][:n])
            for k in range(count - half):
                rows[k].add_(nodes[k + half][:n])
            levels = levels[1:]
        elif messages is None:
            self._rows64_in.copy_(self._in_order)  # float32 -> float64: exact
        else:
            size = self.nodes * n
            for r, message in enumerate(messages):
                self._rows64_in[:, r].copy_(message[:size].view(self.nodes, n))
        if self.format == "fold":
            for count, half in levels:
                _fold_(rows, count, half)
            return self._scaled(rows[0], out)
        spare = self._half
        count = self.terms
        # A fixed pairwise tree over the slice index (a function of V alone): rows 2i
        # and 2i + 1 are added into row i, an odd last row is carried to the next level.
        while count > 1:
            half = count // 2
            torch.add(rows[0:2 * half:2], rows[1:2 * half:2], out=spare[:half])
            if count % 2:
                spare[half].copy_(rows[count - 1])
            count = half + count % 2
            rows, spare = spare, rows
        return self._scaled(rows[0], out)

    def _scaled(self, total: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` = ``total`` / V: in float64 in place (``total`` is scratch), then the
        cast (one op each: a division with a cast in it runs a slower mixed-type loop)."""
        if self._inverse is not None:
            total.mul_(self._inverse)
        else:
            total.div_(self._divisor)
        flat = out.view(-1)
        flat.copy_(total)
        return flat

    def _fill(self, slots: torch.Tensor | Sequence[Column]) -> None:
        """The local rows into ``rows_view``, unless they are there already."""
        if isinstance(slots, torch.Tensor):
            if slots.data_ptr() == self.rows_view.data_ptr():
                return
        elif len(slots) == 1 and slots[0] is self.rows_view:  # the reducer's one segment
            return
        columns = columns_of(slots, self.rows, self.n, self.segments)
        a = 0
        for size, column in zip(self.segments, columns, strict=True):
            b = a + size
            target = self.rows_view[:, a:b]
            if isinstance(column, torch.Tensor) and column.data_ptr() == target.data_ptr() \
                    and column.shape == target.shape and column.stride() == target.stride():
                a = b
                continue
            if len(column) != self.rows:  # positions are slices: none may be left out
                raise ValueError(f"the gather sum adds rows in slice order: give all "
                                 f"{self.rows} local rows of each segment (zeros for a "
                                 f"missing term), got {len(column)}")
            for m in range(self.rows):
                target[m].copy_(column[m].reshape(-1))
            a = b


__all__ = ["ExactMeanGather", "Gather", "fold_levels"]
