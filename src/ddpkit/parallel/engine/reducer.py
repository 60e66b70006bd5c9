"""The reducer: turns "this gradient is ready" signals into bucketed, overlapped all-reduces.

Life of one synchronized backward:

1. ``arm(divisor)`` (called by the forward) resets every bucket's pending count.
2. Autograd finishes accumulating a parameter's gradient and fires its
   post-accumulate-grad hook. The hook moves the gradient into its slot of the bucket's
   flat buffer (scaling by ``1/divisor`` in the same pass on the default path) and points
   ``param.grad`` at that slot. The first hook of a backward also queues the
   end-of-backward callback with the autograd engine.
3. When a bucket's last gradient arrives, every bucket that is now complete *and* has no
   incomplete bucket before it is launched asynchronously (except on a transport whose
   sum runs inline on this thread, shm: there all buckets launch in step 4). Launching
   strictly in bucket order is what keeps ranks from deadlocking: collectives match by
   issue order, and two ranks may see their gradients arrive in different orders.
4. The end-of-backward callback launches what is left (buckets holding parameters that
   got no gradient, if ``find_unused_parameters``), waits for every bucket in order and
   leaves the averaged gradients in ``param.grad`` (views into the buffers). When it
   returns, ``loss.backward()`` returns.

Unused parameters: without ``find_unused_parameters`` a parameter that got no gradient
is an error (a :class:`~ddpkit.errors.UsageError`, torch's RuntimeError) naming it.
With it, every backward all-reduces "which parameters were used" (locally used counts
every backward since the last synchronized one, so a ``no_sync`` backward's gradients
are reduced too) and a parameter no rank used keeps ``.grad`` None. ``static_graph``
does that detection in the first synchronized backward only and then expects the same
parameters to stay unused, as torch's static graph does.

Averaging (default path): each rank multiplies its gradient by ``1/divisor`` while
copying it into the bucket, then the buckets are summed, which is what torch's
reducer does, so the results are bit-for-bit the same as torch DDP's when bucket layouts
match. With a comm hook the engine does not scale: the hook averages (it gets
``bucket.divisor()``), as with torch's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ddpkit.errors import DdpkitError, UsageError
from ddpkit.parallel.engine.buckets import (
    Allocator,
    Bucket,
    assign_buckets,
    build_buckets,
    default_allocator,
    initial_assignment,
)
from ddpkit.parallel.engine.interfaces import CommHook, Transport
from ddpkit.parallel.grad_bucket import GradBucket
from ddpkit.runtime.lifetime import no_python_tls


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype)


class BucketReducer:
    """The default engine's reducer (the module docstring); implements
    :class:`ddpkit.parallel.engine.interfaces.Reducer`."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: dist.ProcessGroup | None,
        *,
        limits_bytes: Sequence[int],
        find_unused_parameters: bool,
        comm_hook: CommHook | None,
        comm_state: object,
        allocate: Allocator = default_allocator,
        initial_bucketing: str = "reverse",
        transport: Transport,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
    ):
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.limits = list(limits_bytes)
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        # torch's reducer scales a gradient that is already its bucket slot by dividing
        # (only possible there with gradient_as_bucket_view) and any other by multiplying
        # by 1/W; the two round differently when W is not a power of two.
        self.divide_in_place = gradient_as_bucket_view
        self.static_unused: set[int] = set()  # unused in the first static-graph backward
        # Observers (DataParallel's logging data, its sparse gradients): on_event(name,
        # detail) at "comm_start", "compute_end", "comm_end" and "error"; every
        # after_backward callback (sharding's) at the end of each finalized backward, and
        # after_next_backward() once, at the end of the next one.
        self.on_event: Callable[[str, str], None] | None = None
        self.after_backward: list[Callable[[], None]] = []
        # parameters the last synchronized backward left without a gradient (.grad None)
        self.left_unused: set[int] = set()
        self.after_next_backward: Callable[[], None] | None = None
        self.comm_hook = comm_hook
        self.comm_state = comm_state
        self.allocate = allocate
        # how the default path sums a bucket (ddpkit.parallel.engine.transport)
        self.transport = transport

        initial = initial_assignment(self.params, self.limits, initial_bucketing,
                                     relaid=self.relays)
        self.assignment = initial
        self._install(build_buckets(self.params, self.assignment, allocate))

        self.armed = False
        self.divisor = self.world_size
        self.ready = [False] * len(self.params)
        self.used = [False] * len(self.params)  # got a gradient since the last sync
        self.next_to_launch = 0
        self.callback_queued = False
        self.synced_iterations = 0
        self.ready_order: list[int] = []
        self.rebuilt = False
        # A transport whose all-reduce runs on the calling thread and returns complete
        # (shm on CPU buckets) overlaps nothing with backward when launched early: every
        # early launch is only one more point where this rank waits for its slowest peer,
        # and its memory passes evict what autograd is working on. Such buckets are all
        # launched from the end-of-backward callback instead, in the same order.
        self._defer_launches = (
            comm_hook is None and transport.reduces_inline
            and all(p.device.type == "cpu" for p in self.params)
        )
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]

    # -- buckets -------------------------------------------------------------------------

    def _install(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self.bucket_of = [0] * len(self.params)
        self.views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in buckets:
            for i, view in zip(bucket.param_indices, bucket.views):
                self.bucket_of[i] = bucket.index
                self.views[i] = view

    @property
    def relays(self) -> bool:
        """Whether buckets are laid out again by the observed gradient order (torch's
        rule: unless unused parameters are searched for every step)."""
        return self.static_graph or not self.find_unused

    def use_single_initial_bucket(self) -> None:
        """Before any backward: torch's first-iteration layout (one bucket per device and
        dtype, registration order) instead of the guessed reverse order."""
        assignment = initial_assignment(self.params, self.limits, "single", relaid=self.relays)
        if assignment != self.assignment:
            self.assignment = assignment
            self._install(build_buckets(self.params, assignment, self.allocate))

    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for logs and tests)."""
        return [[self.names[i] for i in b.param_indices] for b in self.buckets]

    def bucket_sizes(self) -> list[int]:
        return [b.numel for b in self.buckets]

    def set_comm_hook(self, hook: CommHook, state: object) -> None:
        if self.comm_hook is not None:
            raise UsageError(
                "register_comm_hook or register_builtin_comm_hook can only be called once; "
                "a comm hook is already registered on this DataParallel")
        if not self.synced_iterations:
            # Hooks such as PowerSGD keep per-bucket state keyed by bucket index, so the
            # same buckets as torch DDP's give the same numbers: its layout until the
            # first rebuild. (Registered later, the hook gets the buckets as they are.)
            self.use_single_initial_bucket()
        self.comm_hook = hook
        self.comm_state = state

    def set_static_graph(self) -> None:
        self.static_graph = True

    def maybe_rebuild(self, src: int) -> None:
        """Once, after the first synchronized backward (the second under a static graph):
        re-bucket by the observed order.

        The order every rank uses is the one rank ``src`` (a group rank) observed: ranks
        may see gradients arrive in slightly different orders, and their buckets must be
        identical for the all-reduces to pair up. Called at the same point of the same
        iteration on every rank (the forward after the first synchronized backward),
        including ranks that shadow the others under join.
        """
        if self.rebuilt or self.synced_iterations <= self._order_iteration or not self.relays:
            return
        self.rebuilt = True
        order = torch.zeros(len(self.params), dtype=torch.int64, device=self._comm_device())
        if len(self.ready_order) == len(self.params):
            order.copy_(torch.tensor(self.ready_order, dtype=torch.int64))
        if self.world_size > 1:
            self.transport.broadcast([order], src)
        order_list = order.tolist()
        if sorted(order_list) != list(range(len(self.params))):
            raise DdpkitError(f"rank {src} sent an invalid gradient order while re-bucketing")
        assignment = assign_buckets(self.params, order_list, self.limits)
        if assignment == self.assignment:
            return  # the guess was right: keep the storage, skip the copies
        new = build_buckets(self.params, assignment, self.allocate)
        new_views = {i: v for b in new for i, v in zip(b.param_indices, b.views)}
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is not None and _same_memory(p.grad, self.views[i]):
                    new_views[i].copy_(p.grad)
                    p.grad = new_views[i]
        self.assignment = assignment
        self._install(new)

    def _comm_device(self) -> torch.device:
        return self.params[0].device

    # -- one backward --------------------------------------------------------------------

    def arm(self, divisor: int) -> None:
        """The next backward synchronizes; the summed gradients get divided by ``divisor``."""
        self.armed = True
        self.divisor = divisor
        self.ready = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.pending = len(bucket.param_indices)
            bucket.future = None
            bucket.work = None
        self.next_to_launch = 0
        self.callback_queued = False
        if self.synced_iterations == self._order_iteration:
            self.ready_order = []

    def disarm(self) -> None:
        self.armed = False

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index, param)

        return hook

    @property
    def _order_iteration(self) -> int:
        """The synchronized backward whose gradient order the rebuild follows: the first,
        or under a static graph the second (torch's static graph reduces the whole first
        backward at its end, so its order says nothing)."""
        return 1 if self.static_graph else 0

    @property
    def detects_unused(self) -> bool:
        """Whether this backward finds out which parameters no rank used."""
        return self.find_unused or (self.static_graph and self.synced_iterations == 0)

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if not self.armed:
            # no_sync() (or a backward that did not go through our forward): the
            # gradient accumulates locally and counts as used at the next sync.
            self.used[i] = True
            return
        if self.ready[i]:
            raise self._error(
                f"parameter {self.names[i]!r} received a gradient twice in one backward "
                "(reentrant checkpointing, or two backward passes through one forward); "
                "DataParallel reduces each gradient once per forward: run one backward per forward"
            )
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        self.used[i] = True
        self._mark_ready(i, param)
        if self.buckets[self.bucket_of[i]].pending == 0 and not self._defer_launches:
            self._launch_ready_buckets()

    def _mark_ready(self, i: int, param: torch.Tensor) -> None:
        self._move_into_bucket(i, param)
        self._count_ready(i)

    def _move_into_bucket(self, i: int, param: torch.Tensor) -> None:
        """Parameter ``i``'s gradient into its bucket slot (scaled on the default path);
        ``param.grad`` becomes that slot."""
        view = self.views[i]
        grad = param.grad
        scale = self.comm_hook is None and self.divisor != 1
        with torch.no_grad():
            if grad is None:
                view.zero_()
            elif grad.is_sparse:
                raise self._error(
                    f"parameter {self.names[i]!r} got a sparse gradient but its module does "
                    "not declare one; DataParallel reduces sparse gradients of "
                    "nn.Embedding/nn.EmbeddingBag(sparse=True)"
                )
            elif _same_memory(grad, view):
                if scale and self.divide_in_place:
                    view.div_(self.divisor)
                elif scale:
                    view.mul_(1.0 / self.divisor)
            elif scale:
                # Copy and scale in one pass over memory (what torch's reducer does too).
                torch.mul(grad, 1.0 / self.divisor, out=view)
            else:
                view.copy_(grad)
        param.grad = view

    def _count_ready(self, i: int) -> None:
        """Bookkeeping once parameter ``i``'s gradient is in its bucket."""
        self.ready[i] = True
        if self.synced_iterations == self._order_iteration:
            self.ready_order.append(i)
        self.buckets[self.bucket_of[i]].pending -= 1

    def _launch_ready_buckets(self) -> None:
        while self.next_to_launch < len(self.buckets):
            bucket = self.buckets[self.next_to_launch]
            if bucket.pending:
                return
            self._launch(bucket, bucket.buffer, bucket.views)
            self.next_to_launch += 1

    def _error(self, message: str) -> UsageError:
        """The error to raise, reported to the observer first (torch logs it too)."""
        if self.on_event is not None:
            self.on_event("error", message)
        return UsageError(message)

    def _launch(self, bucket: Bucket, buffer: torch.Tensor, views: list[torch.Tensor]) -> None:
        if self.on_event is not None:
            self.on_event("comm_start", "")
        # Inside backward, autograd keeps a Python object in thread-local state; a Work
        # created now would capture it, and a backend thread freeing that Work at
        # interpreter exit would abort the process (ddpkit.runtime.lifetime).
        with no_python_tls():
            self._launch_now(bucket, buffer, views)

    def _launch_now(self, bucket: Bucket, buffer: torch.Tensor,
                    views: list[torch.Tensor]) -> None:
        if self.comm_hook is not None:
            grad_bucket = GradBucket(
                bucket.index, buffer, [self.params[i] for i in bucket.param_indices], views,
                self.divisor, bucket.index == len(self.buckets) - 1,
            )
            bucket.future = self.comm_hook(self.comm_state, grad_bucket)
            if not callable(getattr(bucket.future, "wait", None)):  # torch.futures / _C.Future
                raise self._error(
                    f"comm_hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} returned "
                    f"{type(bucket.future).__name__}; a comm hook must return a "
                    "torch.futures.Future"
                )
        elif self.world_size > 1:
            # a handle to wait for, or None when the sum is done already (shm)
            bucket.work = self.transport.all_reduce(buffer)

    def _finalize_backward(self) -> None:
        """End-of-backward callback: every bucket reduced, every grad averaged, then return."""
        self.callback_queued = False
        if self.on_event is not None:
            self.on_event("compute_end", "")
        try:
            missing = [i for i, done in enumerate(self.ready) if not done]
            had_grad = {i: self.params[i].grad is not None for i in missing}
            detect = self.detects_unused
            unexpected = [i for i in missing if i not in self.static_unused]
            if unexpected and not detect:
                names = ", ".join(repr(self.names[i]) for i in unexpected[:8])
                more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
                raise self._error(
                    f"DataParallel: parameters got no gradient in this backward: {names}{more}. "
                    "Pass find_unused_parameters=True if the graph skips them on purpose, or "
                    "make sure the loss depends on every parameter (or set requires_grad=False)"
                )
            for i in missing:
                self._mark_ready(i, self.params[i])
            self._launch_ready_buckets()
            globally_used = self._reduce_used_flags() if detect else None
            for bucket in self.buckets:
                self._wait(bucket, bucket.buffer)
            if self.on_event is not None:
                self.on_event("comm_end", "")
            if globally_used is not None and self.static_graph and not self.find_unused:
                self.static_unused = {i for i, used in enumerate(globally_used) if not used}
            self.left_unused = set()
            for i in missing:
                # Unused on every rank and no gradient before: leave .grad as None,
                # like torch, so optimizers skip the parameter.
                unused = (not globally_used[i] if globally_used is not None
                          else i in self.static_unused)
                if unused and not had_grad[i]:
                    self.params[i].grad = None
                    self.left_unused.add(i)
            self.synced_iterations += 1
            for callback in self.after_backward:
                callback()
            after, self.after_next_backward = self.after_next_backward, None
            if after is not None:
                after()
        finally:
            self.armed = False
            self.after_next_backward = None
            self.used = [False] * len(self.params)

    def _reduce_used_flags(self) -> list[bool]:
        flags = torch.tensor(self.used, dtype=torch.int32, device=self._comm_device())
        with no_python_tls():  # see _launch
            if self.world_size > 1:
                self.transport.sum_(flags)
        return [bool(v) for v in flags.tolist()]

    def _wait(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        elif bucket.future is not None:
            result = bucket.future.wait()
            bucket.future = None
            if isinstance(result, (list, tuple)):
                result = result[0]
            if not _same_memory(result, buffer):
                with torch.no_grad():
                    buffer.copy_(result.reshape(-1))

    # -- join: shadowing the collectives of ranks that still have data ---------------------

    def shadow_backward(self, divisor: int) -> None:
        """Issue this rank's share of one backward's collectives with zero gradients."""
        self.divisor = divisor
        for bucket in self.buckets:
            zeros = torch.zeros_like(bucket.buffer)
            views = [zeros[o : o + self.params[i].numel()].view_as(self.params[i])
                     for i, o in zip(bucket.param_indices, bucket.offsets)]
            bucket.future = bucket.work = None
            self._launch(bucket, zeros, views)
            self._wait(bucket, zeros)
        if self.detects_unused:
            self.used = [False] * len(self.params)
            self._reduce_used_flags()
        self.synced_iterations += 1
