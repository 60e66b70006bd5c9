"""One collective call's recipe: validate -> resolve -> agree -> run -> finish.

:mod:`ddpkit.comm.collectives` builds a :class:`Call` per public call (the fast path
excepted), records the local checks on it, and hands it to :func:`execute`. Keeping the
recipe here, apart from the public signatures, is what keeps the rules of
docs/collectives.md in one place: where the agreement happens depends only on the
algorithm the call resolved to (never on whether local validation passed), so ranks
cannot split up and wait forever; a refusal is raised on every rank together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit.comm import agreement, groups, lanes, ops, registry
from ddpkit.comm.agreement import CallSignature
from ddpkit.comm.lanes import CommHandle
from ddpkit.comm.ops import dtype_label
from ddpkit.errors import CommError
from ddpkit.runtime import lifetime

Op = str | dist.ReduceOp
Result = CommHandle | None

_KNOWN_DTYPES = [
    dtype_label(d) for d in (*ops.DTYPES, *ops.COMPLEX_DTYPES, torch.bool, torch.int16)
]


class Call:
    """One collective call on its way through validate -> resolve -> agree -> run -> finish."""

    def __init__(self, collective: str, algo: str, group, async_op: bool, check: bool):
        self.collective = collective
        self.algo_arg = algo
        self.group = group
        self.async_op = async_op
        self.check = check
        self.problem: CommError | None = None
        self.view = _view(group)
        # the call's signature, field by field (CallSignature's names; built only when a
        # row is needed: the shm engine reads these attributes, an in-band algorithm
        # may exchange row() and judge with verdict())
        self.algo, self.op, self.dtype = str(algo), "-", "?"
        self.numel_in = self.numel_out = self.root = -1
        self.name: str | None = None
        self.impl = None
        self.method = None
        self.in_band = False  # set per run by agree(): the algorithm checks the call itself

    @property
    def member(self) -> bool:
        return self.view is not None

    def validate(self, fn: Callable[[], None]) -> None:
        """Run a local check; a refusal is kept, to be raised on every rank together."""
        if self.problem is None:
            try:
                fn()
            except CommError as err:
                self.problem = err

    @property
    def sig(self) -> CallSignature:
        return CallSignature(self.collective, self.algo, self.op, self.dtype, self.numel_in,
                             self.numel_out, self.root, self.problem is not None)

    def row(self) -> list[int]:
        """The signature as the integers an in-band algorithm exchanges."""
        return self.sig.row()

    def verdict(self, rows: list[list[int]]) -> None:
        """Judge every rank's row (exchanged in-band), as the all-gather path does."""
        agreement.verdict(self.sig, rows, **_decode_names())

    def shape(self, dtype: str, numel_in: int, numel_out: int, root: int = -1) -> None:
        self.dtype, self.numel_in, self.numel_out, self.root = dtype, numel_in, numel_out, root

    def resolve(self, device: torch.device, fallback: Callable | None = None) -> None:
        """Pick the algorithm. Runs even after a local refusal: which engine a call lands
        in depends only on the algo argument, the group and the device type, so a rank
        that refuses still meets its peers there and refuses in-band."""
        try:
            self.name, self.impl = registry.resolve_algo(self.algo_arg, _DeviceOnly(device),
                                                    self.group)
        except CommError as err:
            if self.problem is None:
                self.problem = err
            return
        name, impl = self.name, self.impl
        self.name, self.impl = name, impl
        self.algo = name
        if fallback is not None and not callable(getattr(impl, self.collective, None)):
            self.method = lambda *args, signature=None: fallback(impl, *args,
                                                                 signature=signature)
            return
        self.validate(lambda: setattr(self, "method", registry.method(
            impl, name, self.collective)))

    def agree(self, group, device: torch.device) -> None:
        """The call's agreement: in-band where the algorithm carries it (nothing to do
        here unless this rank refused), else the agreement all-gather (``check=True``)."""
        probe = getattr(self.impl, "in_band", None)
        self.in_band = probe is not None and bool(probe(group))
        if self.in_band:
            if self.problem is not None:
                self.impl.refuse(self, group)
                raise self.problem
            return
        if self.check:
            agreement.agree(self.sig, group, self.view.size, device, **_decode_names())
        if self.problem is not None:
            raise self.problem

    def invoke(self, *args) -> None:
        """Run the algorithm's method; in-band algorithms get the signature to check
        (so they are invoked for empty tensors too: a rank with nothing to send must
        still meet a peer whose call has something, and fail with it)."""
        if self.in_band:
            self.method(*args, signature=self)
        else:
            self.method(*args)

    def wire(self, name: str) -> str:
        """The op handed to the algorithm: in-band ones take "avg" and divide in their
        own pass; others get a sum the caller divides (finishing with :meth:`divides`)."""
        if name == "avg" and not self.in_band:
            return "sum"
        return name

    def divides(self, name: str) -> bool:
        return name == "avg" and not self.in_band

    def run(
        self, device: torch.device, body: Callable[[object], None],
        backend_async: Callable[[], object],
        finish: Callable[[], torch.Tensor],
    ) -> Result:
        """Agree, then run ``body(group)`` and ``finish()``; in the background when asked.

        Where the agreement happens depends only on the algorithm the call resolved to
        (the algo argument, the group and the device type), never on whether local
        validation passed, so ranks cannot split up and wait forever.
        """
        if self.problem is not None and not self.check and getattr(
                self.impl, "in_band", None) is None:
            raise self.problem
        if not self.async_op:
            self.agree(self.group, device)
            body(self.group)
            finish()
            return None
        if self.name == "backend" or (self.name is None and self.algo_arg == "backend"):
            # torch's own async work; the (small, blocking) agreement runs first.
            self.agree(self.group, device)
            work = backend_async()

            def after(fut: torch.futures.Future) -> torch.Tensor:
                fut.wait()  # re-raises the backend's error instead of finishing over it
                return finish()

            return CommHandle(work.get_future().then(after))
        ln = lanes.lane(self.group)

        def job(companion) -> torch.Tensor:
            self.agree(companion, device)
            body(companion)
            return finish()

        fut = ln.submit(job)
        if self.problem is not None:
            raise self.problem  # peers get their error from their futures
        return CommHandle(fut)


def _decode_names() -> dict:
    """The names a row's codes are decoded against, for the error message."""
    return {
        "known_algos": ("auto", *registry.algorithms()),
        "known_ops": (*ops.OPS, "-"),
        "known_dtypes": (*_KNOWN_DTYPES, "-"),
    }


class _DeviceOnly:
    """What "auto" may look at: the device, never the dtype, size or values."""

    def __init__(self, device: torch.device):
        self.device = device


_views = lifetime.PerGroup()


def _view(group) -> groups.GroupView | None:
    """groups.view, remembered per group (a call's hot path); a group destroyed takes its
    view with it."""
    try:
        found = _views.get(group)
    except TypeError:  # an unhashable or non-weakrefable group object
        return groups.view(group)
    if found is None:
        found = groups.view(group)
        lifetime.destroy_default_group_at_exit()
        with contextlib.suppress(TypeError):
            _views.set(group, found)
    return found


def not_member(async_op: bool) -> Result:
    # torch makes a collective on a group this rank is not in a no-op; so do we.
    return lanes.completed(None) if async_op else None


def execute(
    call: Call, device: torch.device, operands: tuple, *, restore: Callable[[], None],
    result: torch.Tensor | None, op: str | None = None, reduced: torch.Tensor | None = None,
    alone: Callable[[], object] | None = None, lands: bool = True,
) -> Result:
    """What every collective does once its call is validated and resolved.

    ``operands`` are what the algorithm's method takes before the op and the group (flat
    tensors, a root); ``op`` is the reduction, if any: the algorithm gets its wire form
    and an "avg" it could not divide is divided here, in ``reduced``, on ranks the
    result ``lands`` on. ``alone`` is what a group of one does (a copy between two
    buffers); otherwise such a call does nothing. ``restore`` copies a result back into
    a non-contiguous caller tensor; ``result`` is what a handle's future yields.
    """
    size = call.view.size
    has_payload = not operands or not isinstance(operands[0], torch.Tensor) or (
        operands[0].numel() > 0)

    def args() -> tuple:  # the wire op is known only once the call has agreed
        return operands if op is None else (*operands, call.wire(op))

    def body(group) -> None:
        if size == 1:
            if alone is not None:
                alone()
        elif has_payload or call.in_band:
            call.invoke(*args(), group)

    def finish() -> torch.Tensor | None:
        if lands and op is not None and call.divides(op):
            reduced.div_(size)
        restore()
        return result

    def backend_async():
        return getattr(call.impl, call.collective)(*args(), call.group, async_op=True)

    return call.run(device, body, backend_async, finish)
