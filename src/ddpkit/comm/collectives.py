"""The public collectives: torch's signatures, any registered algorithm underneath.

Every call follows the same recipe so that algorithms stay small:

1. validate locally (op, dtype, sizes, root, algorithm), remembering any refusal, and
   resolve the algorithm (``"auto"``, the default: :mod:`ddpkit.comm.auto`, decided once
   per group and device type);
2. agree with the other ranks on the call's signature, so a refusal or a mismatch
   becomes the same CommError on every rank before payload moves: in-band where the
   algorithm synchronises anyway (shm: inside its first barrier, always on), else by
   the agreement all-gather (``check=True``; the backend, the ring, hierarchical across
   hosts);
3. hand the algorithm 1-D contiguous tensors (non-contiguous ones are copied into a
   contiguous buffer and the result copied back, so they are *handled*, not refused);
4. finish "avg" as a sum divided by the group size (gloo has no AVG, and algorithms
   then only implement the associative ops); in-band algorithms get "avg" and divide
   in their own pass.

Results land in place, as with torch: ``all_reduce`` overwrites ``tensor``; ``reduce``
overwrites it on ``dst`` only (other ranks' tensors are left as they were).

Calling convention: torch's positional order (``all_reduce(tensor, op, group,
async_op)``, ``broadcast(tensor, src, group, async_op)``, ...), so a line moved over from
``torch.distributed`` keeps its meaning; ddpkit's own choices (``algo=``, ``check=``) are
keyword-only. Complex tensors are handled as torch handles them: moved as their real
view by broadcast and all_gather, summed or averaged by all_reduce (other ops on them
raise a ValueError, as torch's do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit import lifetime
from ddpkit.comm import agreement, fast_path, groups, lanes, ops, registry
from ddpkit.comm.agreement import CallSignature
from ddpkit.comm.lanes import CommHandle
from ddpkit.comm.ops import dtype_label
from ddpkit.errors import CommError

Op = str | dist.ReduceOp
Result = CommHandle | None


_KNOWN_DTYPES = [
    dtype_label(d) for d in (*ops.DTYPES, *ops.COMPLEX_DTYPES, torch.bool, torch.int16)
]


def _real(tensor: torch.Tensor) -> torch.Tensor:
    """What the algorithms move: a complex tensor's real view (same memory), else itself."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _as_flat(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A 1-D contiguous tensor sharing the caller's storage when possible, and how to put
    results back when it could not."""
    if tensor.is_contiguous():
        return tensor.view(-1), lambda: None
    work = tensor.contiguous()
    return work.view(-1), lambda: tensor.copy_(work)


def _require_tensor(value, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise CommError(f"{what} must be a torch.Tensor, got {type(value).__name__}")


class _Call:
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
            self.name, self.impl = registry.resolve(self.algo_arg, _DeviceOnly(device),
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


def _not_member(async_op: bool) -> Result:
    # torch makes a collective on a group this rank is not in a no-op; so do we.
    return lanes.completed(None) if async_op else None


def _check_op(call: _Call, op: Op, dtype: torch.dtype) -> str:
    name = str(op)

    def check() -> None:
        nonlocal name
        name = ops.op_name(op)
        ops.check_op(name, dtype, call.collective)

    call.validate(check)
    call.op = name
    return name


def all_reduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    algo: str = "auto",
    check: bool = True,
) -> Result:
    """Reduce ``tensor`` across the group in place (every rank gets the result).

    ``op``: sum, product, min, max, avg (floating dtypes), band/bor/bxor (integers); sum
    and avg also on complex tensors. ``algo``: "ring", "naive_ring", "backend" (torch's
    own), "auto" or any registered name. ``async_op=True`` returns a
    :class:`CommHandle`; otherwise None.
    """
    _require_tensor(tensor, "tensor")
    plain = (algo == "auto" and group is None and not async_op and type(op) is str
             and not tensor.is_complex())
    if plain:
        route = fast_path.lookup(tensor, op)
        if route is not None and tensor.is_contiguous() and tensor.numel():
            route(tensor.view(-1))
            return None
    call = _Call("all_reduce", algo, group, async_op, check)
    if not call.member:
        return _not_member(async_op)
    call.shape(dtype_label(tensor.dtype), tensor.numel(), tensor.numel())
    name = _check_op(call, op, tensor.dtype)
    call.resolve(tensor.device)
    size = call.view.size
    flat, restore = _as_flat(_real(tensor) if call.problem is None else tensor)
    result = _execute(call, tensor.device, (flat,), op=name, reduced=flat,
                      restore=restore, result=tensor)
    if plain and call.in_band and size > 1:
        # validated, resolved and checked in-band: the same call can go straight there
        method, wire = call.method, call.wire(name)
        signature = CallSignature("all_reduce", call.name, call.op, call.dtype, -1, -1, -1,
                                  False)
        direct = getattr(call.impl, "direct_all_reduce", None)
        route = direct(wire, None, signature=signature) if direct is not None else None
        fast_path.remember(tensor, op, route or (
            lambda flat: method(flat, wire, None, signature=signature)))
    return result


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Op = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    algo: str = "auto",
    check: bool = True,
) -> Result:
    """Reduce ``input`` (group size x ``output.numel()`` elements) across ranks; rank i
    gets block i of the result in ``output`` (torch's ``reduce_scatter_tensor``)."""
    _require_tensor(output, "output")
    _require_tensor(input, "input")
    call = _Call("reduce_scatter", algo, group, async_op, check)
    if not call.member:
        return _not_member(async_op)
    size = call.view.size
    call.shape(dtype_label(input.dtype), input.numel(), output.numel())
    name = _check_op(call, op, input.dtype)
    call.validate(lambda: _check_blocks("reduce_scatter", input, output, size, "input", "output"))
    call.resolve(input.device)
    flat_in, _ = _as_flat(input)
    flat_out, restore = _as_flat(output)
    return _execute(call, input.device, (flat_out, flat_in), op=name, reduced=flat_out,
                    restore=restore, result=output, alone=lambda: flat_out.copy_(flat_in))


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    algo: str = "auto",
    check: bool = True,
) -> Result:
    """Concatenate every rank's ``input`` into ``output`` (group size x ``input.numel()``
    elements), in group-rank order (torch's ``all_gather_into_tensor``)."""
    _require_tensor(output, "output")
    _require_tensor(input, "input")
    call = _Call("all_gather", algo, group, async_op, check)
    if not call.member:
        return _not_member(async_op)
    size = call.view.size
    call.shape(dtype_label(input.dtype), input.numel(), output.numel())
    call.validate(lambda: ops.check_dtype(input.dtype, allow_complex=True))
    call.validate(lambda: _check_blocks("all_gather", output, input, size, "output", "input"))
    call.resolve(input.device)
    same = call.problem is None
    flat_in, _ = _as_flat(_real(input) if same else input)
    flat_out, restore = _as_flat(_real(output) if same else output)
    return _execute(call, input.device, (flat_out, flat_in), restore=restore, result=output,
                    alone=lambda: flat_out.copy_(flat_in))


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    algo: str = "auto",
    check: bool = True,
) -> Result:
    """Copy ``tensor`` from global rank ``src`` (or group rank ``group_src``) to every
    rank of the group, in place."""
    _require_tensor(tensor, "tensor")
    call = _Call("broadcast", algo, group, async_op, check)
    if not call.member:
        return _not_member(async_op)
    src = _root(call, src, group_src, "src")
    call.shape(dtype_label(tensor.dtype), tensor.numel(), tensor.numel(), _root_code(src))
    call.validate(lambda: ops.check_dtype(tensor.dtype, allow_complex=True))
    call.validate(lambda: _check_root(call.view, src, "src"))
    call.resolve(tensor.device)
    flat, restore = _as_flat(_real(tensor) if call.problem is None else tensor)
    return _execute(call, tensor.device, (flat, src), restore=restore, result=tensor)


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: Op = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
    *,
    algo: str = "auto",
    check: bool = True,
) -> Result:
    """Reduce ``tensor`` across the group onto global rank ``dst`` (or group rank
    ``group_dst``), in place there."""
    _require_tensor(tensor, "tensor")
    call = _Call("reduce", algo, group, async_op, check)
    if not call.member:
        return _not_member(async_op)
    dst = _root(call, dst, group_dst, "dst")
    call.shape(dtype_label(tensor.dtype), tensor.numel(), tensor.numel(), _root_code(dst))
    name = _check_op(call, op, tensor.dtype)
    call.validate(lambda: _check_root(call.view, dst, "dst"))
    call.resolve(tensor.device)
    flat, restore = _as_flat(tensor)
    # Only the destination's tensor holds the result; the others' stay as they were.
    is_dst = call.problem is None and call.view.global_rank(call.view.rank) == dst
    return _execute(call, tensor.device, (flat, dst), op=name, reduced=flat,
                    restore=restore if is_dst else _nothing, result=tensor, lands=is_dst)


def barrier(
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    *,
    algo: str = "auto",
    check: bool = True,
) -> Result:
    """Wait until every rank of the group has called ``barrier`` (torch's ``dist.barrier``).

    With "auto" on one host this is one shared-memory barrier (no backend call); an
    algorithm without a barrier of its own all-reduces one element instead.
    ``device_ids`` (torch's, for NCCL) is accepted: the barrier needs no device of its
    own here, it runs on the group's device.
    """
    call = _Call("barrier", algo, group, async_op, check)
    if not call.member:
        return _not_member(async_op)
    call.shape("-", 0, 0)
    device = _group_device(group)
    call.resolve(device, fallback=_token_barrier(device))
    return _execute(call, device, (), restore=_nothing, result=None)


def _nothing() -> None:
    pass


def _execute(
    call: _Call, device: torch.device, operands: tuple, *, restore: Callable[[], None],
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


def _token_barrier(device: torch.device) -> Callable:
    """A barrier for algorithms without one: all-reduce one element (an in-band
    algorithm gets the barrier's signature with it, so it checks the call as a barrier)."""
    def run(impl, group, signature=None) -> None:
        token = torch.zeros(1, dtype=torch.int32, device=device)
        if signature is None:
            impl.all_reduce(token, "sum", group)
        else:
            impl.all_reduce(token, "sum", group, signature=signature)
    return run


def _group_device(group) -> torch.device:
    """The device a backend's collectives run on: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cuda" if backend == "nccl" else "cpu")


def _root(call: _Call, root, group_root, what: str):
    """torch's two ways to name a root: a global rank, or (``group_src``/``group_dst``) a
    rank of the group. Exactly one of them."""
    if group_root is None:
        if root is None:
            call.validate(lambda: _refuse(f"pass {what}= (a global rank) or group_{what}="))
        return root
    if root is not None:
        call.validate(lambda: _refuse(f"pass {what}= or group_{what}=, not both"))
        return root
    found = root
    def translate() -> None:
        nonlocal found
        if not isinstance(group_root, int) or not 0 <= group_root < call.view.size:
            raise CommError(f"group_{what}={group_root!r} is not a rank of this group of "
                            f"{call.view.size}")
        found = call.view.global_rank(group_root)
    call.validate(translate)
    return found


def _refuse(message: str) -> None:
    raise CommError(message)


def _root_code(root) -> int:
    return root if isinstance(root, int) and root >= 0 else -2


def _check_root(g: groups.GroupView, root, what: str) -> None:
    if not isinstance(root, int) or isinstance(root, bool):
        raise CommError(f"{what} must be an int (a global rank), got {root!r}")
    g.group_rank_of(root, what)


def _check_blocks(
    collective: str, big: torch.Tensor, small: torch.Tensor, size: int, big_name: str,
    small_name: str,
) -> None:
    if big.dtype != small.dtype:
        raise CommError(
            f"{collective}: {big_name} is {big.dtype} but {small_name} is {small.dtype}; "
            "use one dtype"
        )
    if big.device != small.device:
        raise CommError(f"{collective}: {big_name} and {small_name} are on different devices")
    if big.numel() != size * small.numel():
        raise CommError(
            f"{collective}: {big_name} has {big.numel()} elements but needs group size x "
            f"{small_name} = {size} x {small.numel()} = {size * small.numel()}"
        )
