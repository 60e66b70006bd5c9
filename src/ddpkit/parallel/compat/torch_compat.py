"""torch DistributedDataParallel's surface, mapped onto ddpkit's engine.

``ddpkit.DataParallel`` takes torch 2.13's DDP signature so a script switches engines by
changing one import. Each torch argument is either honoured (translated here into the
engine's own settings) or refused with one line naming the argument, why, and what to
use instead: silently ignoring an argument would make a script behave differently
without saying so. :class:`TorchMethods` holds torch DDP's methods that the engine
itself does not need (scatter/gather helpers, the buffer-sync query, built-in hooks,
torch's private debugging API), so that ``DataParallel`` carries the same names.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from ddpkit.errors import ConfigError, UsageError
from ddpkit.parallel.engine.buckets import MIB

# Where torch's _set_params_and_buffers_to_ignore_for_model leaves the names to skip.
IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"
# torch DDP's: buffers and parameters are broadcast in messages of at most this size.
BROADCAST_BUCKET_BYTES = 250 * MIB


class TorchArgumentError(ConfigError):
    """A torch DDP constructor argument that ddpkit's engine cannot honour."""


def _as_device(value: Any) -> torch.device:
    if isinstance(value, int):
        # torch DDP reads a bare int as an index on the accelerator (cuda:<int>).
        return torch.device("cuda", value)
    return torch.device(value)


def _module_devices(module: nn.Module) -> set[torch.device]:
    return {p.device for p in module.parameters()}


def single_device(module: nn.Module, device_ids: Sequence[Any] | None,
                  output_device: Any) -> torch.device | None:
    """The device inputs are moved to before forward (torch's ``device_ids[0]``), or None.

    torch accepts ``device_ids=None`` (module stays where it is, inputs untouched) or a
    one-element list naming the module's own device; anything else is refused.
    """
    devices = _module_devices(module)
    if device_ids is None:
        if output_device is not None:
            raise TorchArgumentError(
                f"output_device={output_device!r} needs device_ids naming the module's device; "
                "pass device_ids=[dev] too, or drop output_device")
        return None
    ids = list(device_ids)
    where = ", ".join(sorted(str(d) for d in devices)) or "no device"
    if len(ids) != 1:
        raise TorchArgumentError(
            f"device_ids={ids!r}: DataParallel runs one device per process (as torch DDP "
            "does since 2.x); pass device_ids=[the module's device] or None")
    if len(devices) > 1:
        raise TorchArgumentError(
            f"device_ids={ids!r} but the module spans {where}; a multi-device module needs "
            "device_ids=None")
    try:
        wanted = _as_device(ids[0])
    except (RuntimeError, TypeError):
        raise TorchArgumentError(f"device_ids={ids!r}: {ids[0]!r} is not a device") from None
    module_device = next(iter(devices)) if devices else wanted
    if wanted != module_device:
        raise TorchArgumentError(
            f"device_ids={ids!r} but the module is on {where}; move the module there first "
            f"(model.to(device)), or pass device_ids=None")
    if output_device is not None and _as_device(output_device) != module_device:
        raise TorchArgumentError(
            f"output_device={output_device!r} differs from the module's device "
            f"{module_device}; outputs stay on the module's device, drop output_device")
    return module_device


def _refuse_if(condition: bool, message: str) -> None:
    if condition:
        raise TorchArgumentError(message)


def engine_settings(
    *,
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    process_group: Any,
    group: Any,
    bucket_cap_mb: float | None,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    device_mesh: Any,
    skip_all_reduce_unused_params: bool,
    bucket_cap_mb_list: Any,
) -> dict[str, Any]:
    """The engine's settings for torch's arguments; refuses those it cannot honour.

    Buffers, as torch 2.13 reads its two arguments for them: ``forward_sync_buffers``
    wins when given (and buffers are always part of the initial broadcast);
    ``broadcast_buffers``, deprecated in torch (a FutureWarning, torch's words), also
    decides whether buffers are part of the initial broadcast (False keeps rank-local
    buffers).
    """
    if broadcast_buffers is not None:
        warnings.warn(
            "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
            "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still "
            "syncs buffers at init." if forward_sync_buffers is None else
            "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
            "`broadcast_buffers` is deprecated and its value is ignored when "
            "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        sync_buffers, init_sync_buffers = bool(forward_sync_buffers), True
    else:
        sync_buffers = init_sync_buffers = broadcast_buffers is None or bool(broadcast_buffers)
    if process_group is not None and group is not None and process_group is not group:
        raise TorchArgumentError(
            "process_group and group name different groups (they are the same option); "
            "pass one of them")
    _refuse_if(device_mesh is not None,
               "device_mesh is not supported by ddpkit.DataParallel; pass "
               "process_group=mesh.get_group() instead")
    _refuse_if(delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None,
               "delay_all_reduce_named_params/param_to_hook_all_reduce are not supported by "
               "ddpkit.DataParallel; drop them (every gradient is reduced in its bucket)")
    _refuse_if(mixed_precision is not None,
               "mixed_precision (torch DDP's private _MixedPrecision) is not supported by "
               "ddpkit.DataParallel; use torch.autocast, or comm_hook=bf16_compress_hook")
    _refuse_if(bool(skip_all_reduce_unused_params),
               "skip_all_reduce_unused_params=True is not supported by ddpkit.DataParallel; "
               "drop it (unused parameters are reduced as zeros, same result)")
    _refuse_if(bucket_cap_mb_list is not None,
               "bucket_cap_mb_list is not supported by ddpkit.DataParallel; use bucket_cap_mb "
               "and first_bucket_cap_mb=")
    return {
        "broadcast_buffers": sync_buffers,
        "init_sync_buffers": init_sync_buffers,
        "group": group if group is not None else process_group,
        "bucket_cap_mb": 25.0 if bucket_cap_mb is None else bucket_cap_mb,
    }


def move_inputs(device: torch.device, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What torch DDP does with ``device_ids``: copy tensor inputs to the module's device."""
    from torch.utils._pytree import tree_map

    def to(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) else x

    return tree_map(to, args), tree_map(to, kwargs)


class TorchMethods:
    """torch DDP's methods and properties that are not the engine (a mixin of
    DataParallel: reads its ``forward_sync_buffers``, ``require_forward_param_sync``,
    ``modules_buffers``, ``dim``, ``device_type``, ``process_group``, ``static_graph``,
    ``find_unused_parameters``, ``reducer``, ``_logging``)."""

    def _set_torch_attributes(self, settings: dict[str, Any], *, device_ids: Any,
                              output_device: Any, dim: int, bucket_cap_given: bool,
                              static_graph: bool, find_unused_parameters: bool,
                              gradient_as_bucket_view: bool, batched_grad_copy: bool) -> None:
        """torch DDP's public attributes, from its arguments (``settings``: what
        :func:`engine_settings` made of them). ``dim``, ``check_reduction`` and
        ``batched_grad_copy`` need nothing more (see DataParallel's docstring)."""
        self.device_ids = None if device_ids is None else list(device_ids)
        self._input_device = single_device(self.module, device_ids, output_device)
        self.output_device = self._input_device
        self.dim = dim
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy
        self.bucket_bytes_cap_default = not bucket_cap_given
        self.bucket_bytes_cap = int(settings["bucket_cap_mb"] * MIB)
        self.broadcast_bucket_size = BROADCAST_BUCKET_BYTES
        self.forward_sync_buffers = settings["broadcast_buffers"]
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.mixed_precision = None
        self.skip_all_reduce_unused_params = False
        # torch's switch for to_kwargs' copies to an accelerator (read the same way)
        self.use_side_stream_for_tensor_copies = (
            os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1")
        self.parameters_to_ignore = set(getattr(self.module, IGNORE_ATTRIBUTE, ()))

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (torch's method)."""
        return (self.require_forward_param_sync and self.forward_sync_buffers
                and len(self.modules_buffers) > 0)

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
        """torch DDP's method (torch's scatter_kwargs along ``dim``)."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: Any) -> Any:
        """torch DDP's method: ``inputs`` and ``kwargs`` moved to ``device_id``."""
        return _to_kwargs(inputs, kwargs, torch.device(self.device_type, device_id),
                          self.use_side_stream_for_tensor_copies)

    def gather(self, outputs: Any, output_device: Any) -> Any:
        """torch DDP's method (torch's gather along ``dim``)."""
        return gather(outputs, output_device, dim=self.dim)

    def train(self, mode: bool = True):
        super().train(mode)
        return self

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hooks by type: ALLREDUCE and FP16_COMPRESS."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in hooks:
            self._raise(ConfigError(f"unknown built-in comm hook {comm_hook_type!r}"))
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])
        self._logging.set("comm_hook", str(comm_hook_type))

    # -- torch DDP's private debugging API (used by tools and by torch's own tests) -------

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
            module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Names (``"layer.weight"``) that DataParallel neither broadcasts nor reduces."""
        setattr(module, IGNORE_ATTRIBUTE, list(params_and_buffers_to_ignore))

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch DDP's logging dictionary (see :mod:`ddpkit.parallel.compat.ddp_logging`)."""
        return self._logging.snapshot()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            self._raise(ConfigError(
                "DDP runtime logging sample rate should be equal or greater than 1"))
        self._logging.set_sample_rate(sample_rate)

    @property
    def _distributed_rank(self) -> int:
        return dist.get_rank(self.process_group)

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
        self.reducer.set_static_graph()
        if self.find_unused_parameters:
            warnings.warn(
                "find_unused_parameters=True is not needed with _set_static_graph(): unused "
                "parameters are found automatically (they must stay unused)", stacklevel=2)
