"""Uneven inputs: ranks that run out of data shadow the others' collectives.

Without help, a rank with fewer batches leaves the training loop while the others enter
the next backward and wait forever (until the process-group timeout) for its share of
the bucket all-reduce. Inside ``with ddpkit.join(model):``

* every forward starts with one small all-reduce in which each still-training rank
  raises its own flag (and says whether this iteration synchronizes gradients, so
  ``no_sync`` keeps working);
* a rank that leaves the ``with`` body keeps answering that all-reduce with "not
  training" and, for every iteration the others still run, issues the same collectives
  they do (buffer broadcast, bucket all-reduces with zero gradients) until nobody trains;
* finally every rank takes the parameters and buffers of the highest rank that
  trained until the end (torch's choice), so replicas are identical again.

Averaging while some ranks have stopped: joined ranks contribute zeros. With
``divide_by_initial_world_size=True`` (the default, as torch) the sum is divided by the
world size, so an iteration with k of W ranks left gets (sum of k gradients) / W: late
batches weigh less, the step size stays stable. With ``False`` the sum is divided by k,
the exact mean over the ranks still training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import ConfigError
from ddpkit.parallel.ddp import DataParallel
from ddpkit.parallel.engine.join_state import JoinState


@contextlib.contextmanager
def join(
    models: DataParallel | DistributedDataParallel | Sequence[DataParallel],
    *,
    divide_by_initial_world_size: bool = True,
    enable: bool = True,
) -> Iterator[None]:
    """Context manager for training loops whose ranks have different numbers of batches.

    ``models``: one DataParallel (or a list of them, each run forward+backward once per
    iteration, in list order) or a torch DistributedDataParallel, for which torch's own
    ``Join`` is used. Inside the block, every forward with grad enabled must be followed
    by its backward (the joined ranks mirror both). See the module docstring for how
    gradients are averaged once some ranks have finished.
    """
    if isinstance(models, (DataParallel, DistributedDataParallel)):
        models = [models]
    models = list(models)
    if not models:
        raise ConfigError("join() needs at least one model")
    if all(isinstance(m, DistributedDataParallel) for m in models):
        from torch.distributed.algorithms.join import Join

        with Join(models, enable=enable,
                  divide_by_initial_world_size=divide_by_initial_world_size):
            yield
        return
    for m in models:
        if not isinstance(m, DataParallel):
            raise ConfigError(
                f"join() takes ddpkit.DataParallel models (or torch DDP ones, not mixed); got "
                f"{type(m).__name__}"
            )
        if m._join_state is not None:
            raise ConfigError("this model is already inside a join() block")
    if not enable:
        yield
        return
    states = [JoinState(m, divide_by_initial_world_size) for m in models]
    for m, state in zip(models, states):
        m._join_state = state
    try:
        yield
        _shadow_until_all_done(models, states)
    finally:
        for m in models:
            m._join_state = None


def _shadow_until_all_done(models: list[DataParallel], states: list[JoinState]) -> None:
    while True:
        anyone_left = False
        for m, state in zip(models, states):
            active, sync = state.exchange(m, active=False, sync=False)
            if active:
                anyone_left = True
                m._shadow_iteration(active, sync, state.divisor(len(active)))
        if not anyone_left:
            break
    for m, state in zip(models, states):
        if len(state.last_active) < state.world_size:
            m._sync_final_state(max(state.last_active))
