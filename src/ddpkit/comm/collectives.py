"""The public collectives: torch's signatures, any registered algorithm underneath.

Every call follows the same recipe (:mod:`ddpkit.comm.call`) so that algorithms stay
small:

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

from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit.comm import fast_path, groups, ops
from ddpkit.comm.agreement import CallSignature
from ddpkit.comm.call import Call, Op, Result, execute, not_member
from ddpkit.comm.ops import dtype_label
from ddpkit.errors import CommError


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


def _check_op(call: Call, op: Op, dtype: torch.dtype) -> str:
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
            route(tensor)  # a contiguous tensor of any shape: no flat view per call
            return None
    call = Call("all_reduce", algo, group, async_op, check)
    if not call.member:
        return not_member(async_op)
    call.shape(dtype_label(tensor.dtype), tensor.numel(), tensor.numel())
    name = _check_op(call, op, tensor.dtype)
    call.resolve(tensor.device)
    size = call.view.size
    flat, restore = _as_flat(_real(tensor) if call.problem is None else tensor)
    result = execute(call, tensor.device, (flat,), op=name, reduced=flat,
                      restore=restore, result=tensor)
    if plain and call.in_band and size > 1:
        # validated, resolved and checked in-band: the same call can go straight there
        method, wire = call.method, call.wire(name)
        signature = CallSignature("all_reduce", call.name, call.op, call.dtype, -1, -1, -1,
                                  False)
        direct = getattr(call.impl, "direct_all_reduce", None)
        route = direct(wire, None, signature=signature) if direct is not None else None
        fast_path.remember(tensor, op, route or (
            lambda t: method(t.view(-1), wire, None, signature=signature)))
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
    call = Call("reduce_scatter", algo, group, async_op, check)
    if not call.member:
        return not_member(async_op)
    size = call.view.size
    call.shape(dtype_label(input.dtype), input.numel(), output.numel())
    name = _check_op(call, op, input.dtype)
    call.validate(lambda: _check_blocks("reduce_scatter", input, output, size, "input", "output"))
    call.resolve(input.device)
    flat_in, _ = _as_flat(input)
    flat_out, restore = _as_flat(output)
    return execute(call, input.device, (flat_out, flat_in), op=name, reduced=flat_out,
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
    call = Call("all_gather", algo, group, async_op, check)
    if not call.member:
        return not_member(async_op)
    size = call.view.size
    call.shape(dtype_label(input.dtype), input.numel(), output.numel())
    call.validate(lambda: ops.check_dtype(input.dtype, allow_complex=True))
    call.validate(lambda: _check_blocks("all_gather", output, input, size, "output", "input"))
    call.resolve(input.device)
    same = call.problem is None
    flat_in, _ = _as_flat(_real(input) if same else input)
    flat_out, restore = _as_flat(_real(output) if same else output)
    return execute(call, input.device, (flat_out, flat_in), restore=restore, result=output,
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
    call = Call("broadcast", algo, group, async_op, check)
    if not call.member:
        return not_member(async_op)
    src = _root(call, src, group_src, "src")
    call.shape(dtype_label(tensor.dtype), tensor.numel(), tensor.numel(), _root_code(src))
    call.validate(lambda: ops.check_dtype(tensor.dtype, allow_complex=True))
    call.validate(lambda: _check_root(call.view, src, "src"))
    call.resolve(tensor.device)
    flat, restore = _as_flat(_real(tensor) if call.problem is None else tensor)
    return execute(call, tensor.device, (flat, src), restore=restore, result=tensor)


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
    call = Call("reduce", algo, group, async_op, check)
    if not call.member:
        return not_member(async_op)
    dst = _root(call, dst, group_dst, "dst")
    call.shape(dtype_label(tensor.dtype), tensor.numel(), tensor.numel(), _root_code(dst))
    name = _check_op(call, op, tensor.dtype)
    call.validate(lambda: _check_root(call.view, dst, "dst"))
    call.resolve(tensor.device)
    flat, restore = _as_flat(tensor)
    # Only the destination's tensor holds the result; the others' stay as they were.
    is_dst = call.problem is None and call.view.global_rank(call.view.rank) == dst
    return execute(call, tensor.device, (flat, dst), op=name, reduced=flat,
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
    call = Call("barrier", algo, group, async_op, check)
    if not call.member:
        return not_member(async_op)
    call.shape("-", 0, 0)
    device = _group_device(group)
    call.resolve(device, fallback=_token_barrier(device))
    return execute(call, device, (), restore=_nothing, result=None)


def _nothing() -> None:
    pass


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


def _root(call: Call, root, group_root, what: str):
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
