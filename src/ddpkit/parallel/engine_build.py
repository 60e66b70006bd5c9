"""DataParallel's engine, built from its checked options: one reducer, one transport.

* Exact mode (``exact=True``): :class:`~ddpkit.parallel.exact.exact_transport.ExactTransport`
  and the :class:`~ddpkit.parallel.exact.exact_reducer.ExactReducer` that runs on it.
* Otherwise the transport ``comm=`` chose (:mod:`ddpkit.parallel.engine.transport`;
  for a loaded copy, which must not communicate, a lazy one), the bucketed reducer on it
  (ZeRO-2 and 3's scatter reducer under ``shard="gradients" | "parameters"``), and
  around them ZeRO's sharding, the reducer of sparse embedding gradients and torch's
  logging data watching the reducer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ddpkit.parallel.compat.ddp_logging import LoggingData
from ddpkit.parallel.compat.ddp_pickle import LazyTransport
from ddpkit.parallel.compat.sparse_grads import SparseReducer, sparse_parameters
from ddpkit.parallel.engine import transport
from ddpkit.parallel.engine.buckets import allocator_from
from ddpkit.parallel.engine.interfaces import Reducer, Transport
from ddpkit.parallel.engine.reducer import BucketReducer
from ddpkit.parallel.exact.exact_reducer import ExactReducer
from ddpkit.parallel.exact.exact_transport import ExactTransport
from ddpkit.parallel.zero.scatter_reducer import ScatterReducer
from ddpkit.parallel.zero.sharding import Sharding, agree_on_mode


@dataclass(frozen=True)
class Engine:
    transport: Transport
    reducer: Reducer
    sparse: SparseReducer | None  # sparse embedding gradients, reduced as torch does
    sharding: Sharding | None  # shard != "none"
    logging: LoggingData


def build_engine(model: Any, trainable: list[tuple[str, nn.Parameter]], *,
                 lazy: bool) -> Engine:
    """The engine of ``model`` (a DataParallel being built, or loaded: ``lazy``, then never
    sharded nor exact) for its ``trainable`` parameters. Collective unless ``lazy``."""
    params = [p for _, p in trainable]
    if model._options.exact:
        exact = ExactTransport(model._options.comm, params[0].device, model.group)
        reducer = ExactReducer(model.module, trainable, model.group, exact,
                               slices=model._options.slices,
                               find_unused_parameters=model.find_unused_parameters)
        return Engine(exact, reducer, None, None,
                      LoggingData(model, params, model.bucket_bytes_cap))
    return _bucketed(model, trainable, lazy=lazy)


def _bucketed(model: Any, trainable: list[tuple[str, nn.Parameter]], *, lazy: bool) -> Engine:
    options, group = model._options, model.group
    sparse_ids = sparse_parameters(model.module)
    dense = [(n, p) for n, p in trainable if id(p) not in sparse_ids]
    sparse = [(n, p) for n, p in trainable if id(p) in sparse_ids]
    device_types = sorted({p.device.type for _, p in trainable})
    if lazy and options.comm in ("auto", "shm") and device_types == ["cpu"]:
        moves: Transport = LazyTransport(
            lambda: transport.build(options.comm, device_types, group))
        allocate = moves.allocate
    else:
        moves = transport.build(options.comm, device_types, group)
        allocate = allocator_from(options.comm_state, moves.allocate)
    scatters = model.shard in ("gradients", "parameters")
    reducer = (ScatterReducer if scatters else BucketReducer)(
        [p for _, p in dense], [n for n, _ in dense], group,
        limits_bytes=options.limits,
        find_unused_parameters=model.find_unused_parameters,
        comm_hook=options.comm_hook, comm_state=options.comm_state, allocate=allocate,
        initial_bucketing=options.initial_bucketing, transport=moves,
        static_graph=model.static_graph, gradient_as_bucket_view=model.gradient_as_bucket_view,
    )
    if not lazy:  # collective; a loaded copy is never sharded (ddp_pickle)
        agree_on_mode(model.shard, group)
    sharding = (Sharding(model.shard, reducer, moves, group, model.module)
                if model.shard != "none" else None)
    sparse_reducer = None
    if sparse:
        sparse_reducer = SparseReducer([p for _, p in sparse], [n for n, _ in sparse], group,
                                       reducer if dense else None, len(reducer.buckets))
        sparse_reducer.comm_hook = options.comm_hook
        sparse_reducer.comm_state = options.comm_state
    logging = LoggingData(model, [p for _, p in trainable], model.bucket_bytes_cap)
    logging.set_bucket_sizes([b.numel * b.buffer.element_size() for b in reducer.buckets]
                             + [p.numel() * p.element_size() for _, p in sparse])
    logging.watch(reducer)
    return Engine(moves, reducer, sparse_reducer, sharding, logging)
