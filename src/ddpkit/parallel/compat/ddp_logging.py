"""torch DDP's logging data for a DataParallel: ``_get_ddp_logging_data()``.

torch's DistributedDataParallel keeps a dictionary describing itself (construction
arguments, environment, bucket layout) and, at sampled iterations, how long the forward,
the backward's compute and its communication took (host-side nanoseconds). Tools and
torch's own tests read it through the private methods ``_get_ddp_logging_data()`` and
``_set_ddp_runtime_logging_sample_rate(rate)``, so DataParallel keeps the same keys with
the same meanings:

* runtime stats are taken in synchronized iterations 1-10, then every ``sample_rate``-th
  (default 100), and published at the start of the next synchronized forward, with
  ``iteration`` the number of that iteration (torch's sampling, exactly);
* ``forward_compute_time``: forward start to forward end; ``backward_compute_time``:
  forward end to the last gradient ready; ``backward_comm_time``: first bucket reduction
  launched to every bucket reduced; ``backward_compute_comm_overlap_time``: first
  launch to the last gradient ready (0 when the reductions start after it, as on the
  shared-memory transport); ``avg_*``: their running means over the sampled iterations;
* ``has_error``/``error`` record the last error DataParallel raised
  (``"<class 'RuntimeError'>: message"``, torch's format).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
ALWAYS_SAMPLED = 10  # the first synchronized iterations are always timed


def _env(name: str) -> str:
    return os.environ.get(name, "N/A")


def _cpp_dtype_name(dtype: torch.dtype) -> str:
    # torch's C++ names: float, double, c10::Half, c10::BFloat16, long int, ...
    return {torch.float32: "float", torch.float64: "double"}.get(
        dtype, str(dtype).removeprefix("torch."))


def _gloo_threads(group) -> int | None:
    pg = group if group is not None else dist.group.WORLD
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return None
    threads = getattr(getattr(backend, "options", None), "_threads", None)
    return threads if isinstance(threads, int) else None


class LoggingData:
    """The dictionary and the sampled timings of one DataParallel."""

    def __init__(self, model: Any, params: list[nn.Parameter], bucket_cap_bytes: int):
        group = model.process_group
        backend = str(dist.get_backend(group))
        data: dict[str, Any] = {
            "world_size": model.world_size,
            "rank": model.rank,
            "module_name": type(model.module).__name__,
            "device_ids": ", ".join(str(getattr(d, "index", d)) for d in model.device_ids or []),
            "output_device": (-1 if model.output_device is None or model.output_device.index
                              is None else model.output_device.index),
            "broadcast_buffers": int(model.forward_sync_buffers),
            "bucket_cap_bytes": bucket_cap_bytes,
            "find_unused_parameters": int(model.find_unused_parameters),
            "gradient_as_bucket_view": int(model.gradient_as_bucket_view),
            "backend_name": backend,
            "is_multi_device_module": int(model.is_multi_device_module),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm)
                                   for m in model.module.modules())),
            "iteration": 0,
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(sorted({_cpp_dtype_name(p.dtype) for p in params})),
            "bucket_sizes": "",
            "master_port": _env("MASTER_PORT"),
            "master_addr": _env("MASTER_ADDR"),
            "torch_distributed_debug": _env("TORCH_DISTRIBUTED_DEBUG"),
            "cuda_visible_devices": _env("CUDA_VISIBLE_DEVICES"),
        }
        if backend == "gloo":
            data["gloo_socket_ifname"] = _env("GLOO_SOCKET_IFNAME")
            data["gloo_device_transport"] = _env("GLOO_DEVICE_TRANSPORT")
            threads = _gloo_threads(group)
            if threads is not None:
                data["gloo_num_threads"] = threads
        self.data = data
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.iterations = 0  # synchronized forwards so far
        self.recorded = 0  # sampled iterations published
        self._times: dict[str, int] = {}
        self._sampling = False
        self._reducer: Any = None  # the bucketed reducer whose events and layout it reports

    def watch(self, reducer: Any) -> None:
        """Report ``reducer``'s events (its ``on_event``) and, for sampled iterations,
        its bucket layout (a bucketed reducer: ``buckets``, ``static_unused``, ``rebuilt``,
        ``ready_order``). Exact mode's reducer is not watched: its logging data is the
        construction data."""
        self._reducer = reducer
        reducer.on_event = self.on_event

    # -- what DataParallel and its reducer report ------------------------------------------

    def set_bucket_sizes(self, sizes: list[int]) -> None:
        self.data["bucket_sizes"] = ", ".join(str(s) for s in sizes)

    def set_sample_rate(self, rate: int) -> None:
        self.sample_rate = rate

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def error(self, kind: type, message: str) -> None:
        self.data["has_error"] = 1
        self.data["error"] = f"{kind}: {message}"

    def _sampled(self, iteration: int) -> bool:
        return iteration > 0 and (iteration <= ALWAYS_SAMPLED
                                  or iteration % self.sample_rate == 0)

    def forward_start(self) -> None:
        """A synchronized forward begins: publish the last sampled iteration, then
        decide whether this one is timed."""
        if self._sampled(self.iterations) and self._reducer is not None:
            self._publish(self._reducer)
        self.iterations += 1
        self._sampling = self._sampled(self.iterations)
        self._times = {"forward_start": time.time_ns()} if self._sampling else {}

    def forward_end(self) -> None:
        if self._sampling:
            self._times["compute_start"] = time.time_ns()

    def on_event(self, name: str, detail: str) -> None:
        """The reducer's events (see BucketReducer.on_event)."""
        if name == "error":
            self.error(RuntimeError, detail)
        elif self._sampling and name not in self._times:
            self._times[name] = time.time_ns()

    def _publish(self, reducer: Any) -> None:
        t = self._times
        if {"forward_start", "compute_start", "compute_end", "comm_end"} - set(t):
            return  # the sampled iteration had no backward (or a failed one)
        comm_start = t.get("comm_start", t["compute_end"])
        self.recorded += 1
        data = self.data
        data["iteration"] = self.iterations
        durations = {
            "forward_compute_time": t["compute_start"] - t["forward_start"],
            "backward_compute_time": t["compute_end"] - t["compute_start"],
            "backward_comm_time": t["comm_end"] - comm_start,
            "backward_compute_comm_overlap_time": max(t["compute_end"] - comm_start, 0),
        }
        for key, value in durations.items():
            data[key] = value
            previous = data.get(f"avg_{key}", 0)
            data[f"avg_{key}"] = (value + previous * (self.recorded - 1)) // self.recorded
        data["forward_compute_time_start"] = t["forward_start"]
        data["backward_compute_time_start"] = t["compute_start"]
        data["backward_compute_time_end"] = t["compute_end"]
        data["backward_comm_time_start"] = comm_start
        data["backward_comm_time_end"] = t["comm_end"]
        data["num_buckets_reduced"] = len(reducer.buckets)
        data["unused_parameter_size"] = sum(
            reducer.params[i].numel() * reducer.params[i].element_size()
            for i in reducer.static_unused)
        if reducer.rebuilt and data.get("has_rebuilt_buckets") != 1:
            data["has_rebuilt_buckets"] = 1
            data["rebuilt_bucket_sizes"] = ", ".join(
                str(b.numel * b.buffer.element_size()) for b in reducer.buckets)
            data["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(str(i) for i in b.param_indices) for b in reducer.buckets)
            data["prev_iteration_grad_ready_order_indices"] = ", ".join(
                str(i) for i in reducer.ready_order)

    def snapshot(self) -> dict[str, Any]:
        return dict(self.data)
