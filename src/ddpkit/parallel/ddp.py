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
import inspect
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddpkit import host_malloc, lifetime
from ddpkit.errors import ConfigError, ConfigTypeError, UsageError
from ddpkit.parallel.compat import torch_compat
from ddpkit.parallel.compat.ddp_logging import LoggingData
from ddpkit.parallel.compat.ddp_pickle import LazyTransport, pickled_state
from ddpkit.parallel.compat.sparse_grads import SparseReducer, sparse_parameters
from ddpkit.parallel.compat.torch_compat import IGNORE_ATTRIBUTE, TorchMethods
from ddpkit.parallel.engine import transport
from ddpkit.parallel.engine.buckets import MIB, Allocator, size_limits
from ddpkit.parallel.engine.join_state import ModelJoin, TorchJoinHook
from ddpkit.parallel.engine.reducer import CommHook, Reducer
from ddpkit.parallel.engine.state_sync import broadcast_coalesced, verify_same_layout
from ddpkit.parallel.exact import exact_reducer
from ddpkit.parallel.zero import sharded_state
from ddpkit.parallel.zero.scatter_reducer import ScatterReducer
from ddpkit.parallel.zero.sharding import Sharding, agree_on_mode, check_mode

# torch DDP's: buffers and parameters are broadcast in messages of at most this size.
BROADCAST_BUCKET_BYTES = 250 * MIB


def _allocator_from(comm_state: object, default: Allocator) -> Allocator:
    """Use ``comm_state.allocate`` for bucket storage when the state offers it, else
    ``default`` (the transport's).

    This is how a shared-memory communicator gets gradients written straight into its
    segment by backward: the bucket buffers *are* its memory.
    """
    allocate = getattr(comm_state, "allocate", None)
    if allocate is None or not callable(allocate):
        return default
    try:
        takes_device = len(inspect.signature(allocate).parameters) >= 3
    except (TypeError, ValueError):
        takes_device = True
    if takes_device:
        return lambda numel, dtype, device: allocate(numel, dtype, device)

    def without_device(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return default(numel, dtype, device)
        return allocate(numel, dtype)

    return without_device


class DataParallel(TorchMethods, nn.Module, Joinable):
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
        # torch's arguments first: dim, check_reduction and batched_grad_copy need
        # nothing here (see the class docstring).
        self.device_ids = None if device_ids is None else list(device_ids)
        self._input_device = torch_compat.single_device(module, device_ids, output_device)
        self.output_device = self._input_device
        self.dim = dim
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy
        self.bucket_bytes_cap_default = bucket_cap_mb is None
        settings = torch_compat.engine_settings(
            broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers,
            process_group=process_group, group=group, bucket_cap_mb=bucket_cap_mb,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
            device_mesh=device_mesh, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list)
        group = settings["group"]
        bucket_cap_mb = settings["bucket_cap_mb"]
        if comm_hook is not None and not callable(comm_hook):
            raise ConfigTypeError(
                f"comm_hook must be callable as hook(state, bucket), got {comm_hook!r}")
        if callable(comm):
            if comm_hook is not None:
                raise ConfigError("pass the comm hook once: comm=hook or comm_hook=hook")
            comm_hook, comm = comm, "backend"
        elif comm not in transport.COMM_CHOICES:
            raise ConfigError(f"comm must be one of {', '.join(transport.COMM_CHOICES)} or a "
                              f"comm hook, got {comm!r}")
        elif comm_hook is not None and comm != "auto":
            raise ConfigError(f"comm={comm!r} and comm_hook both choose how buckets are "
                              "reduced; pass one of them")
        if first_bucket_cap_mb is None and not self.bucket_bytes_cap_default:
            # torch 2.13: a bucket_cap_mb given by the user caps the first bucket too
            # (the smaller first bucket is part of the default only)
            first_bucket_cap_mb = bucket_cap_mb
        try:
            limits = size_limits(bucket_cap_mb, first_bucket_cap_mb)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.shard = check_mode(shard)
        if exact and self.shard != "none":
            raise ConfigError(f"exact mode sums whole gradients on every rank; shard={shard!r} "
                              "does not combine with it (use shard='none')")
        if slices is not None and not exact:
            raise ConfigError("slices is exact mode's: DataParallel(model, exact=True, "
                              "slices=V)")
        if self.shard != "none" and comm_hook is not None:
            raise ConfigError(f"shard={shard!r} reduce-scatters the buckets itself; a comm hook "
                              "needs shard='none'")
        if initial_bucketing not in ("reverse", "single"):
            raise ConfigError(
                f"initial_bucketing must be 'reverse' or 'single', got {initial_bucketing!r}")
        self.module = module
        self.forward_sync_buffers = settings["broadcast_buffers"]
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.bucket_bytes_cap = int(bucket_cap_mb * MIB)
        self.broadcast_bucket_size = BROADCAST_BUCKET_BYTES
        self.mixed_precision = None
        self.skip_all_reduce_unused_params = False
        # torch's switch for to_kwargs' copies to an accelerator (read the same way)
        self.use_side_stream_for_tensor_copies = (
            os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1")
        self.parameters_to_ignore = set(getattr(module, IGNORE_ATTRIBUTE, ()))
        # ddpkit's options, kept so that a pickled copy builds the same engine
        self._engine_options = {"comm": comm, "comm_hook": comm_hook, "comm_state": comm_state,
                                "limits": limits, "initial_bucketing": initial_bucketing}
        self._attach(group)
        self._check_module()
        if init_sync:
            named_params = self._named_parameters()
            verify_same_layout(named_params, self.named_module_buffers, group)
            # Rank 0's initial state wins, so replicas start identical whatever seeds were used.
            buffers = self.modules_buffers if settings["init_sync_buffers"] else []
            broadcast_coalesced([p.detach() for _, p in named_params] + buffers, 0, group)
        if exact:  # sums gradients itself, with its own collectives: no buckets, no transport
            trainable = [(n, p) for n, p in self._named_parameters() if p.requires_grad]
            exact_reducer.attach(self, module, trainable, group, slices=slices,
                                 comm=comm, comm_hook=comm_hook,
                                 find_unused_parameters=find_unused_parameters)
            self.sparse = None
            self._logging = LoggingData(self, [p for _, p in trainable], self.bucket_bytes_cap)
            return
        self._build_engine(lazy=False)

    # -- construction, also run when a pickled copy is loaded ------------------------------

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters()
                if n not in self.parameters_to_ignore]

    def _attach(self, group: dist.ProcessGroup | None) -> None:
        """The process group and what follows from it and the module (no communication)."""
        self.group = group
        # torch's gloo threads must be joined before the interpreter finalizes: destroy
        # the default group at exit if the program does not (ddpkit.lifetime).
        lifetime.destroy_default_group_at_exit()
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._sharding: Sharding | None = None  # built with the engine
        self._join_state = None  # set by ddpkit.join while its context is open
        self._torch_join_state = None  # set by torch's Join through join_hook()
        self.exact: exact_reducer.ExactReducer | None = None  # exact mode's reducer (exact=True)
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
            # in the heap so that they do not fault in again every step (host_malloc)
            host_malloc.keep_large_blocks_here()

    def _check_module(self) -> None:
        """What torch refuses about the module itself, before any communication."""
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

    def _build_engine(self, *, lazy: bool) -> None:
        """Reducer(s), transport and logging data for the trainable parameters."""
        options = self._engine_options
        trainable = [(n, p) for n, p in self._named_parameters() if p.requires_grad]
        sparse_ids = sparse_parameters(self.module)
        dense = [(n, p) for n, p in trainable if id(p) not in sparse_ids]
        sparse = [(n, p) for n, p in trainable if id(p) in sparse_ids]
        if sparse and self.shard != "none":
            raise ConfigError(f"shard={self.shard!r} needs dense gradients; {sparse[0][0]} has "
                              "sparse ones (nn.Embedding(sparse=True)): use shard='none'")
        comm_hook, comm_state = options["comm_hook"], options["comm_state"]
        # A hook reduces the buckets itself: "auto" then keeps them in private memory.
        wanted = "backend" if comm_hook is not None else options["comm"]
        device_types = sorted({p.device.type for _, p in trainable})
        group = self.group
        if lazy and wanted in ("auto", "shm") and device_types == ["cpu"]:
            self.transport = LazyTransport(lambda: transport.build(wanted, device_types, group))
            allocate = self.transport.allocate
        else:
            self.transport = transport.build(wanted, device_types, group)
            allocate = _allocator_from(comm_state, self.transport.allocate)
        reducer_class = ScatterReducer if self.shard in ("gradients", "parameters") else Reducer
        self.reducer = reducer_class(
            [p for _, p in dense], [n for n, _ in dense], group,
            limits_bytes=options["limits"],
            find_unused_parameters=self.find_unused_parameters,
            comm_hook=comm_hook, comm_state=comm_state, allocate=allocate,
            initial_bucketing=options["initial_bucketing"], transport=self.transport,
            static_graph=self.static_graph, gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        if not lazy:  # collective; a loaded copy is never sharded (ddp_pickle)
            agree_on_mode(self.shard, group)
        if self.shard != "none":
            self._sharding = Sharding(self.shard, self.reducer, self.transport, group,
                                      self.module)
        self.sparse = None
        if sparse:
            self.sparse = SparseReducer([p for _, p in sparse], [n for n, _ in sparse], group,
                                        self.reducer if dense else None,
                                        len(self.reducer.buckets))
            self.sparse.comm_hook, self.sparse.comm_state = comm_hook, comm_state
        self._logging = LoggingData(self, [p for _, p in trainable], self.bucket_bytes_cap)
        self._logging.set_bucket_sizes(
            [b.numel * b.buffer.element_size() for b in self.reducer.buckets]
            + [p.numel() * p.element_size() for _, p in sparse])
        self.reducer.on_event = self._logging.on_event

    def __getstate__(self) -> dict:
        return pickled_state(self)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._attach(None)
        self._build_engine(lazy=True)

    @property
    def process_group(self) -> dist.ProcessGroup:
        """torch DDP's attribute: the group replicated over (the default group when none
        was given). Looked up, not held: a model alive at exit must not keep the default
        group, and its gloo threads, alive past its destruction (ddpkit.lifetime)."""
        return self.group if self.group is not None else _default_group()

    @property
    def comm(self) -> str:
        """The transport the buckets go through ("shm", "backend", "ring")."""
        return self.transport.name

    def _raise(self, error: Exception) -> NoReturn:
        """Raise ``error``, recorded first in the logging data (as torch logs its own)."""
        self._logging.error(next(t for t in type(error).__mro__
                                 if t.__module__ == "builtins"), str(error))
        raise error

    # -- forward -------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" in sys.modules:  # torch.compile may be tracing this call
            _before_forward_eagerly(self)
        else:  # importing torch._dynamo costs 1.6 s: not for programs that never compile
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
            self._logging.forward_start(self.reducer)
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
        self.require_forward_param_sync = sync

    def _sync_buffers(self, src: int) -> None:
        # Through the transport: the shared segment under comm="shm" (no backend call in
        # a steady-state step), torch's broadcast otherwise.
        if self.world_size > 1:
            self.transport.broadcast(self._buffers_to_sync, src, every_step=True)

    # -- join ----------------------------------------------------------------------------

    def _shadow_iteration(self, active: list[int], sync: bool, divisor: int) -> None:
        """Issue the collectives one forward+backward on the active ranks will issue."""
        src = max(active)
        if sync:
            self.reducer.maybe_rebuild(src)
        self._forward_buffers(src, sync)
        if sync:
            self.reducer.shadow_backward(divisor)
            if self.sparse is not None:
                self.sparse.shadow_backward(divisor)

    def _sync_final_state(self, src: int) -> None:
        """After join: ranks that stopped early take the last trainer's parameters."""
        tensors = [p.detach() for p in self.module.parameters()] + self._buffers_to_sync
        self.transport.broadcast(tensors, src)

    # torch's Joinable interface: torch.distributed.algorithms.Join([model, ...]) drives the
    # same shadowing as ddpkit.join (see ddpkit.parallel.engine.join_state.TorchJoinHook).

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self._logging.set("join_uneven_inputs", 1)
        return TorchJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch DDP's method: ``with model.join(): ...`` lets ranks with fewer batches
        leave their loop early (torch's ``Join`` over this model; see ddpkit.join)."""
        return ModelJoin([self], enable, throw_on_early_termination,
                         divide_by_initial_world_size=divide_by_initial_world_size)

    @property
    def join_device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

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
        if self.reducer.comm_hook is not None:
            self._raise(UsageError(
                "register_comm_hook or register_builtin_comm_hook can only be called once; "
                "a comm hook is already registered on this DataParallel"))
        if not self.reducer.synced_iterations:
            # Hooks such as PowerSGD keep per-bucket state keyed by bucket index, so the
            # same buckets as torch DDP's give the same numbers: its layout until the
            # first rebuild. (Registered later, the hook gets the buckets as they are.)
            self.reducer.use_single_initial_bucket()
        for reducer in self._reducers():
            reducer.comm_hook = hook
            reducer.comm_state = state
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

    # -- sharding (shard="optimizer" | "gradients" | "parameters"); pass-throughs with "none"

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters, or with sharding this rank's shard of them: one
        parameter per module parameter with elements on this rank (what the optimizer
        should hold)."""
        if self._sharding is None:
            return super().parameters(recurse)
        return iter(self._sharding.params.shards)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        if self._sharding is None:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        dot = f"{prefix}." if prefix else ""
        return iter([(f"{dot}module.{name}", p) for name, p in self._sharding.params.named()])

    def gather_parameters(self) -> None:
        """Give the wrapped module the full updated parameters now (collective; with
        sharding the next forward and ``state_dict()`` do it by themselves; nothing to do
        without sharding). Call it before reading ``model.module``'s weights directly;
        with ``shard="parameters"`` they stay in memory until the next forward (and
        before it the module's parameter tensors have no memory: reading one can crash
        the process)."""
        if self._sharding is None:
            return
        if self._sharding.layers is not None:
            self._sharding.layers.hold()
        elif self._sharding.params.stale:
            self._sharding.params.gather()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """torch's state dict of the full (unsharded) module, ``module.`` prefixed
        (collective with sharding; with ``shard="parameters"`` copies of the gathered
        values, which are freed again unless gather_parameters() holds them)."""
        layers = self._sharding.layers if self._sharding is not None else None
        held = layers is not None and layers.held
        self.gather_parameters()
        state = super().state_dict(*args, **kwargs)
        if layers is not None:
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.clone()
            if not held:
                layers.release_all()
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if self._sharding is not None and self._sharding.layers is not None:
            if assign:
                raise ConfigError("load_state_dict(assign=True) would replace the tensors "
                                  "shard='parameters' gathers into; load without assign")
            self.gather_parameters()  # the shards take the loaded values (LayerGathering)
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self._sharding is not None:
            self._sharding.params.stale = False  # every rank loaded the same full values
        return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` on the gradients the optimizer will use (this rank's
        shards with sharding: the norm is then over every rank's); returns the total norm."""
        if self._sharding is None:
            return torch.nn.utils.clip_grad_norm_(self.reducer.params, max_norm, norm_type)
        return self._sharding.clip_grad_norm_(max_norm, norm_type)

    def optimizer_shard_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """With sharding: (what every rank shares, this rank's part) of the optimizer's
        state, cut by parameter so that any world size can load it
        (:mod:`ddpkit.parallel.zero.sharded_state`; ddpkit's checkpoints store the parts as
        one file per rank)."""
        if self._sharding is None:
            raise ConfigError("optimizer_shard_state needs DataParallel(shard='optimizer' or "
                              "'gradients'); without sharding use optimizer.state_dict()")
        return sharded_state.split_state(optimizer, self._sharding.params, self.reducer.names)

    def load_optimizer_shards(self, optimizer: torch.optim.Optimizer, common: Any,
                              parts: Any) -> None:
        """Give ``optimizer`` this rank's shard of a state saved by
        :meth:`optimizer_shard_state` on every rank of a run of any world size (``parts``:
        each saved rank's part, any order)."""
        if self._sharding is None:
            raise ConfigError("load_optimizer_shards needs DataParallel(shard='optimizer' or "
                              "'gradients'); this model is not sharded")
        sharded_state.load_state(optimizer, self._sharding.params, self.reducer.names, common,
                                 parts)

    def load_unsharded_optimizer_state(self, optimizer: torch.optim.Optimizer,
                                       state_dict: Any) -> None:
        """Give ``optimizer`` this rank's shard of an unsharded optimizer's
        ``state_dict()`` (one built on the module's parameters, its groups by the same
        rule as ``optimizer``'s): a run continues sharded from a checkpoint written
        without sharding. Collective."""
        if self._sharding is None:
            raise ConfigError("load_unsharded_optimizer_state needs DataParallel(shard=...); "
                              "without sharding use optimizer.load_state_dict()")
        groups = sharded_state.unsharded_groups(optimizer, self._sharding.params, self.group)
        common, part = sharded_state.from_unsharded(
            state_dict, self.reducer.params, self.reducer.names, len(self.reducer.buckets),
            groups)
        self.load_optimizer_shards(optimizer, common, [part])

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of tensors the optimizer keeps as state on this rank."""
        return sharded_state.state_bytes(optimizer)

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

    def _set_static_graph(self) -> None:
        """Mark the graph static after construction (prefer ``static_graph=True``)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self._logging.iterations:
            self._raise(UsageError(
                "_set_static_graph() should be called before training loop starts and after "
                "DataParallel is constructed; pass static_graph=True to the constructor"))
        self.static_graph = True
        self.reducer.static_graph = True
        if self.find_unused_parameters:
            warnings.warn(
                "find_unused_parameters=True is not needed with _set_static_graph(): unused "
                "parameters are found automatically (they must stay unused)", stacklevel=2)

    def extra_repr(self) -> str:
        sizes = [sum(self.reducer.params[i].numel() for i in b.param_indices)
                 for b in self.reducer.buckets]
        return (f"world_size={self.world_size}, comm={self.comm}, shard={self.shard}, "
                f"buckets={len(sizes)} (numel {sizes})")


def _default_group() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


# Collectives and Python-side bookkeeping: under torch.compile they run eagerly (a graph
# break) and only the wrapped module's forward is compiled. torch._disable_dynamo imports
# dynamo on first call, not here.
_before_forward_eagerly = torch._disable_dynamo(DataParallel._before_forward)
_forward_end_eagerly = torch._disable_dynamo(LoggingData.forward_end)
