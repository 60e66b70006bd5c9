"""DataParallel: ddpkit's own distributed data-parallel engine.

Contract with the user, the same as torch's DistributedDataParallel:

* The constructor is a synchronization point. It checks that every rank built the same
  model and copies rank 0's parameters and buffers to everyone, so replicas start equal.
* Forward is the wrapped module's forward. Before it runs, buffers (BatchNorm running
  statistics) are broadcast from rank 0 (``broadcast_buffers=True``): every rank then
  normalizes with its own batch's statistics but carries rank 0's running averages.
* When ``loss.backward()`` returns, every parameter's ``.grad`` holds the gradient
  averaged over ranks; the reduction ran in buckets while backward was still going (see
  :mod:`ddpkit.parallel.engine.reducer`). Replicas stay identical because every rank then
  applies the same optimizer step to the same parameters with the same gradients.
* ``no_sync()`` skips the reduction (gradient accumulation); :func:`ddpkit.join` lets
  ranks with fewer batches finish early without hanging the others.

The constructor takes torch 2.13 DDP's arguments, positionally and by keyword, so a
script switches engines by changing its import (:mod:`ddpkit.parallel.compat.torch_compat` says
which are honoured and refuses the rest in one line). The module stays where the caller
put it, possibly across several devices (model parallel inside each replica; then
``device_ids=None``). Buckets are per (device, dtype).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from ddpkit.errors import ConfigError, ConfigTypeError, UsageError
from ddpkit.launcher import worker_heap
from ddpkit.parallel.compat import torch_compat
from ddpkit.parallel.compat.ddp_logging import LoggingData
from ddpkit.parallel.compat.ddp_pickle import loaded_options, pickled_state
from ddpkit.parallel.compat.sparse_grads import sparse_parameters
from ddpkit.parallel.compat.torch_compat import TorchMethods
from ddpkit.parallel.engine.interfaces import CommHook, Reducer, Transport
from ddpkit.parallel.engine.join_state import JoinMethods
from ddpkit.parallel.engine.state_sync import broadcast_coalesced, verify_same_layout
from ddpkit.parallel.engine_build import build_engine
from ddpkit.parallel.engine_options import EngineOptions, check_options
from ddpkit.parallel.exact import exact_reducer
from ddpkit.parallel.exact.exact_reducer import ExactReducer
from ddpkit.parallel.zero.sharding import Sharding
from ddpkit.parallel.zero.sharding_methods import ShardingMethods
from ddpkit.runtime import lifetime


class DataParallel(ShardingMethods, JoinMethods, TorchMethods, nn.Module, Joinable):
    """Replicate ``module`` across the ranks of ``group`` and average gradients in backward.

    torch DDP's arguments (positional or keyword, same order as torch 2.13):

    * honoured: ``device_ids`` (None, or ``[the module's device]``: inputs are moved
      there before forward), ``output_device`` (None or that device), ``dim`` (only
      matters for multi-device scatter, which DDP no longer does), ``broadcast_buffers`` /
      ``forward_sync_buffers``, ``init_sync`` (False: no layout check and no initial
      broadcast), ``process_group`` (= ``group``), ``bucket_cap_mb`` (None: 25),
      ``find_unused_parameters``, ``static_graph`` (unused parameters are found in the
      first backward and expected to stay unused, no per-step detection afterwards),
      ``gradient_as_bucket_view`` (``.grad`` is always a view into its bucket here; the
      flag only chooses torch's rounding: an accumulated gradient is divided by the world
      size, not multiplied by its inverse, as torch's reducer does with the flag);
    * accepted with nothing to do: ``check_reduction`` (deprecated in torch),
      ``batched_grad_copy`` (a copy strategy; same numbers);
    * refused, one line each: ``device_mesh``, ``delay_all_reduce_named_params``,
      ``param_to_hook_all_reduce``, ``mixed_precision``,
      ``skip_all_reduce_unused_params=True``, ``bucket_cap_mb_list``.

    Its methods and attributes are torch DDP's (``no_sync``, ``join``, ``join_hook``,
    ``register_comm_hook``, ``will_sync_module_buffers``, ``process_group``,
    ``require_backward_grad_sync``, ...; docs/ddp-engine.md has the full table), it
    pickles and deep-copies like torch's (:mod:`ddpkit.parallel.compat.ddp_pickle`), reduces
    sparse embedding gradients (:mod:`ddpkit.parallel.compat.sparse_grads`), and its errors are
    torch's exception types with ddpkit's messages.

    ddpkit's own options (keyword-only):

    Args:
        module: the model, already on its device(s); every rank builds the same one.
        comm: how buckets are all-reduced (see :mod:`ddpkit.parallel.engine.transport`):
            ``"auto"`` (default: ``"shm"`` for a CPU module whose ranks share a host,
            ``"backend"`` for CUDA and everything else, decided once here), ``"backend"``
            (torch's all_reduce: bit-identical to torch DDP), ``"ring"`` (ddpkit's ring),
            ``"shm"`` (buckets live in the host's shared memory; backward writes gradients
            there and the sum runs in place), or a comm hook (same as ``comm_hook=``).
        bucket_cap_mb: size cap of a gradient bucket in MiB (the first bucket is capped at
            ``first_bucket_cap_mb``).
        broadcast_buffers: copy rank 0's buffers to every rank before each forward that
            follows a synchronized one (torch's rule, ``require_forward_param_sync``).
        find_unused_parameters: allow parameters that get no gradient in a backward;
            without it such a parameter raises an error naming it.
        comm_hook: ``hook(state, bucket) -> Future[Tensor]`` replacing the all-reduce of a
            bucket (see :mod:`ddpkit.parallel.hooks`); it must average (``bucket.divisor()``).
        comm_state: passed to the hook; if it has ``allocate(numel, dtype, device)``, bucket
            storage is allocated through it.
        group: the process group to replicate over (default: the whole world).
        first_bucket_cap_mb: cap of the first bucket (the gradients ready first); by
            default 1 MiB, or ``bucket_cap_mb`` when that is given (torch 2.13's rule).
        initial_bucketing: layout until the first backward has shown the real gradient
            order: ``"reverse"`` (reverse registration order, size-capped buckets: overlap
            from the first step) or ``"single"`` (one bucket per device and dtype in
            registration order, reduced at the end: torch 2.x's layout, which makes results
            bit-identical to torch DDP's at any world size; with find_unused_parameters
            and no static graph, torch's size-capped buckets, which it never re-lays).
        shard: ``"none"`` (default), ``"optimizer"`` (ZeRO-1), ``"gradients"`` (ZeRO-2) or
            ``"parameters"`` (ZeRO-3): ``model.parameters()`` then yields this rank's
            pieces of the module's parameters, so the optimizer built on them holds 1/W
            of the state (see
            :mod:`ddpkit.parallel.zero.sharding`).
        exact: the same bits at any world size (:mod:`ddpkit.parallel.exact.exact_reducer`):
            each step is ``slices`` slices of the batch run through :meth:`slices`,
            their gradients summed exactly; see docs/exact.md.
        slices: exact mode's slices per step (the world size must divide it);
            ``ddpkit.Run(..., exact=True)`` sets it from its sampler when left out.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        comm_hook: CommHook | None = None,
        comm_state: object = None,
        group: dist.ProcessGroup | None = None,
        first_bucket_cap_mb: float | None = None,
        initial_bucketing: str = "reverse",
        comm: str | CommHook = "auto",
        shard: str = "none",
        exact: bool = False,
        slices: int | None = None,
    ):
        super().__init__()
        Joinable.__init__(self)
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "DataParallel needs a process group: call ddpkit.init() (or run under "
                "`ddpkit launch`) before wrapping the model"
            )
        if isinstance(module, DataParallel):
            raise ConfigError("module is already a DataParallel; wrap the plain model once")
        # 1. Every option checked, in one place, before any communication: torch's
        #    arguments mapped to the engine's settings, then ddpkit's options together.
        settings = torch_compat.engine_settings(
            broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers,
            process_group=process_group, group=group, bucket_cap_mb=bucket_cap_mb,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
            device_mesh=device_mesh, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list)
        self._options: EngineOptions = check_options(
            bucket_cap_mb=settings["bucket_cap_mb"], cap_given=bucket_cap_mb is not None,
            first_bucket_cap_mb=first_bucket_cap_mb, comm=comm, comm_hook=comm_hook,
            comm_state=comm_state, initial_bucketing=initial_bucketing, shard=shard,
            exact=exact, slices=slices)
        self.shard = self._options.shard
        self.module = module
        self._set_torch_attributes(
            settings, device_ids=device_ids, output_device=output_device, dim=dim,
            bucket_cap_given=bucket_cap_mb is not None, static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, batched_grad_copy=batched_grad_copy)
        if self._options.exact:  # it refuses a buffer changed during a step: none to sync
            self.forward_sync_buffers = False
        # 2. The group, and what follows from it and the module.
        self._attach(settings["group"])
        # 3. What the module itself must satisfy, refused before any communication.
        self._check_module()
        # 4. Every rank built the same model; rank 0's state wins.
        if init_sync:
            self._initial_sync(with_buffers=settings["init_sync_buffers"])
        # 5. The reducer and its transport (and around them sharding, sparse gradients,
        #    the logging data), or exact mode's pair.
        self._build_engine(lazy=False)

    # -- construction, also run when a pickled copy is loaded ------------------------------

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters()
                if n not in self.parameters_to_ignore]

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self._named_parameters() if p.requires_grad]

    def _attach(self, group: dist.ProcessGroup | None) -> None:
        """The process group and what follows from it and the module (no communication)."""
        self.group = group
        # torch's gloo threads must be joined before the interpreter finalizes: destroy
        # the default group at exit if the program does not (ddpkit.runtime.lifetime).
        lifetime.destroy_default_group_at_exit()
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._sharding: Sharding | None = None  # built with the engine
        self._join_state = None  # set by ddpkit.join while its context is open
        self._torch_join_state = None  # set by torch's Join through join_hook()
        self.named_module_buffers = [(n, b) for n, b in self.module.named_buffers()
                                     if n not in self.parameters_to_ignore]
        self.modules_buffers = [b for _, b in self.named_module_buffers]
        self._buffers_to_sync = self.modules_buffers
        devices = {p.device for p in self.module.parameters()}
        self.is_multi_device_module = len(devices) > 1
        self.device = next(iter(self.module.parameters())).device if devices else None
        self.device_type = self.device.type if self.device is not None else "cpu"
        if "cpu" in {d.type for d in devices}:
            # autograd allocates CPU gradients anew each backward: keep freed large blocks
            # in the heap so that they do not fault in again every step (worker_heap)
            worker_heap.keep_large_blocks_here()

    def _check_module(self) -> None:
        """What torch refuses about the module itself, and what the chosen mode needs of
        it, before any communication."""
        params = [p for _, p in self._named_parameters()]
        if not any(p.requires_grad for p in params):
            raise UsageError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient (DataParallel: nothing to reduce; set "
                "requires_grad on the parameters to train, or do not wrap the module)")
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in params):
            raise UsageError(
                "Modules with uninitialized parameters can't be used with DataParallel "
                "(lazy modules): run a dummy forward pass first to initialize them")
        if self.device_type == "cpu" and any(isinstance(m, nn.SyncBatchNorm)
                                             for m in self.module.modules()):
            raise ConfigError("SyncBatchNorm layers only work with GPU modules; use "
                              "nn.BatchNorm* on CPU (buffers are broadcast before forward)")
        if self._options.exact:
            exact_reducer.check_module(self.module, self._trainable())
        sparse_ids = sparse_parameters(self.module)
        sparse = [n for n, p in self._trainable() if id(p) in sparse_ids]
        if sparse and self.shard != "none":
            raise ConfigError(f"shard={self.shard!r} needs dense gradients; {sparse[0]} has "
                              "sparse ones (nn.Embedding(sparse=True)): use shard='none'")

    def _initial_sync(self, *, with_buffers: bool) -> None:
        """Check that every rank built the same model, then copy rank 0's parameters (and
        buffers) to everyone, so replicas start identical whatever seeds were used."""
        named_params = self._named_parameters()
        verify_same_layout(named_params, self.named_module_buffers, self.group)
        buffers = self.modules_buffers if with_buffers else []
        broadcast_coalesced([p.detach() for _, p in named_params] + buffers, 0, self.group)

    def _build_engine(self, *, lazy: bool) -> None:
        """The reducer and the transport for the trainable parameters, and around them
        (:mod:`ddpkit.parallel.engine_build`)."""
        engine = build_engine(self, self._trainable(), lazy=lazy)
        self.transport: Transport = engine.transport
        self.reducer: Reducer = engine.reducer
        self.sparse = engine.sparse
        self._sharding = engine.sharding
        self._logging = engine.logging

    def __getstate__(self) -> dict:
        return pickled_state(self)

    def __setstate__(self, state: dict) -> None:
        options = loaded_options(state)
        super().__setstate__(state)
        self._options = options
        self._attach(None)
        self._build_engine(lazy=True)

    @property
    def process_group(self) -> dist.ProcessGroup:
        """torch DDP's attribute: the group replicated over (the default group when none
        was given). Looked up, not held: a model alive at exit must not keep the default
        group, and its gloo threads, alive past its destruction (ddpkit.runtime.lifetime)."""
        return self.group if self.group is not None else _default_group()

    @property
    def comm(self) -> str:
        """Where the gradients are summed: the transport's name ("shm", "backend",
        "ring"; in exact mode too, where the sum's two all-reduces run)."""
        return self.transport.name

    @property
    def exact(self) -> ExactReducer | None:
        """Exact mode's reducer (its slice count, step and seed), or None."""
        return self.reducer if isinstance(self.reducer, ExactReducer) else None

    def _check_joinable(self) -> None:
        """Refuse a join (ddpkit.join, torch's Join) the mode cannot take part in, on
        every rank alike, before the join exchanges anything."""
        if self.exact is not None:
            raise ConfigError(exact_reducer.NO_JOIN)

    def _raise(self, error: Exception) -> NoReturn:
        """Raise ``error``, recorded first in the logging data (as torch logs its own)."""
        self._logging.error(next(t for t in type(error).__mro__
                                 if t.__module__ == "builtins"), str(error))
        raise error

    # -- forward -------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # torch.compile may be tracing this call (the checks then stay out of its graph);
        # run eagerly, the plain call (the disabling wrapper costs more than the checks)
        if "torch._dynamo" in sys.modules and torch.compiler.is_compiling():
            _before_forward_eagerly(self)
        else:  # importing torch._dynamo is slow: not for programs that never compile
            self._before_forward()
        if self._input_device is not None:
            args, kwargs = torch_compat.move_inputs(self._input_device, args, kwargs)
        if self._sharding is None:
            output = self.module(*args, **kwargs)
        else:
            with self._sharding.around_forward():
                output = self.module(*args, **kwargs)
        if self.reducer.armed:
            if "torch._dynamo" in sys.modules and torch.compiler.is_compiling():
                _forward_end_eagerly(self._logging)  # a clock read: not graph material
            else:
                self._logging.forward_end()
        return output

    def _before_forward(self) -> None:
        if self._sharding is not None:
            if self._join_state is not None or self._torch_join_state is not None:
                raise ConfigError(f"join() with shard={self.shard!r} is not supported: every "
                                  "rank's optimizer step updates its own shard; give every "
                                  "rank the same number of batches, or use shard='none'")
            self._sharding.before_forward()
        if self._torch_join_state is not None and self._join_config.enable:
            # torch's Join counts iterations through this all-reduce, before ours.
            Join.notify_join_context(self)
            self._join_state = self._torch_join_state
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        src, divisor = 0, self.world_size
        if self._join_state is not None:
            active, sync = self._join_state.exchange(self, active=True, sync=sync)
            src = max(active)  # torch's choice: the highest rank still training
            divisor = self._join_state.divisor(len(active))
        if sync:
            self._logging.forward_start()
            self.reducer.maybe_rebuild(src)
        self._forward_buffers(src, sync)
        for reducer in self._reducers():
            if sync:
                reducer.arm(divisor)
            else:
                reducer.disarm()

    def _reducers(self) -> list:
        return [self.reducer] if self.sparse is None else [self.reducer, self.sparse]

    def _forward_buffers(self, src: int, sync: bool) -> None:
        """torch's rule: buffers are synchronized before a forward that follows a
        synchronized forward (or the first one), so a ``no_sync`` or ``no_grad`` forward
        makes the next forward skip the broadcast."""
        if self.will_sync_module_buffers():
            self._sync_buffers(src)
        if self.require_forward_param_sync != sync:  # (Module.__setattr__ is slow)
            self.require_forward_param_sync = sync

    def _sync_buffers(self, src: int) -> None:
        # Through the transport: the shared segment under comm="shm" (no backend call in
        # a steady-state step), torch's broadcast otherwise.
        if self.world_size > 1:
            self.transport.broadcast(self._buffers_to_sync, src, every_step=True)

    # -- user API ------------------------------------------------------------------------

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """torch DDP's API: reduce each bucket with ``hook(state, bucket)`` from now on.

        torch's own hooks (``default_hooks.allreduce_hook``, ``fp16_compress_hook``,
        ``powerSGD_hook`` with a ``PowerSGDState``) run unchanged. Register once (torch's
        rule); usually before the first forward, but later works too, as with torch.
        """
        if not callable(hook):
            self._raise(ConfigTypeError(
                f"register_comm_hook: hook must be callable as hook(state, bucket), got "
                f"{hook!r} (torch: Communication hook must be callable.)"))
        try:
            self.reducer.set_comm_hook(hook, state)
        except UsageError as error:  # a second hook (torch's RuntimeError), logged as torch's
            self._raise(error)
        if self.sparse is not None:
            self.sparse.comm_hook, self.sparse.comm_state = hook, state
        self._logging.set("comm_hook", getattr(hook, "__qualname__", repr(hook)))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate local gradients without reducing.

        The first forward+backward *after* the block reduces the accumulated gradients.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def slices(self, *tensors: torch.Tensor) -> Iterator[Any]:
        """Exact mode: this rank's slices of its local batch, one at a time.

        ``for xs, ys in model.slices(x, y):`` yields each of this rank's V/W slices
        (every tensor cut alike along dim 0; one tensor in, one out) inside its own
        random stream. Run one forward and one backward per slice; when the last
        slice's backward returns, ``.grad`` holds the exact mean over all V slices.
        """
        if self.exact is None:
            raise ConfigError("model.slices() is exact mode's: DataParallel(model, exact=True)")
        return self.exact.slices(tensors)

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per gradient bucket, in the order buckets are reduced."""
        return self.reducer.bucket_names()

    def extra_repr(self) -> str:
        sizes = self.reducer.bucket_sizes()
        return (f"world_size={self.world_size}, comm={self.comm}, shard={self.shard}, "
                f"buckets={len(sizes)} (numel {sizes})")


def _default_group() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


# Collectives and Python-side bookkeeping: under torch.compile they run eagerly (a graph
# break) and only the wrapped module's forward is compiled. torch._disable_dynamo imports
# dynamo on first call, not here.
_before_forward_eagerly = torch._disable_dynamo(DataParallel._before_forward)
_forward_end_eagerly = torch._disable_dynamo(LoggingData.forward_end)
