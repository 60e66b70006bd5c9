"""ZeRO-3 (``DataParallel(model, shard="parameters")``): a bucket's full parameters are in
memory only while a module that holds them runs.

Every rank keeps its shard of each bucket's parameters (:mod:`ddpkit.parallel.zero.sharded_params`).
A module with parameters of its own gets two hooks:

* before its forward, the buckets its parameters are in are gathered (a collective every
  rank issues at the same point of the same program) and every resident bucket that no
  running module needs any more is released, so a forward holds the buckets of the
  module running and of the modules around it;
* after its forward, a gradient hook on each output: when backward reaches the module,
  its buckets are gathered again, since autograd kept views of the weights to compute
  the input's gradient.

The gradients of a bucket are reduce-scattered as soon as its last one arrives
(:mod:`ddpkit.parallel.zero.scatter_reducer`), and then no backward step needs its values any
more: it is released there. A synchronized backward therefore ends with nothing
resident, and the next forward gathers the values the optimizer just stepped.

``model.gather_parameters()`` (and a checkpoint, which calls it) gathers everything and
*holds* it: the hooks then do nothing, so the wrapped module can be evaluated, read or
loaded like a plain one, with no collectives, until the next forward through the
``DataParallel``. Reading or loading the module's state while buckets are released is
refused in one line rather than reading freed memory.

A parameter used outside the forward of a module that holds it (a weight tied to another
layer and read by its parent, ``F.linear(x, self.embed.weight)``) would be read after
its bucket was released. The first forward runs with everything resident and watches
every torch call (a ``TorchFunctionMode``): a parameter passed to one while no module
holding it is running keeps its bucket resident for good, gathered again before every
forward.

Under ``torch.compile`` all of this runs outside the compiled graphs (``_eagerly``): the
collectives and the bookkeeping are not graph material, and a traced gather would be
compiled with the shared slots' byte views in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ddpkit.errors import UsageError
from ddpkit.parallel.zero.sharded_params import ShardedParameters


class LayerGathering:
    """When each bucket's full parameters are gathered and released."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter],
                 bucket_of: Sequence[int], sharded: ShardedParameters):
        self.sharded = sharded
        self.bucket_of_param = {id(p): b for p, b in zip(params, bucket_of)}
        self.holders: dict[int, set[int]] = {}  # id(parameter) -> id(modules holding it)
        self.buckets_of: dict[int, tuple[int, ...]] = {}  # id(module) -> its buckets
        self.running: list[nn.Module] = []  # modules inside their forward, outermost first
        self.always: set[int] = set()  # buckets used outside their modules: kept resident
        self.watched = False  # the first forward ran under the watch
        self.held = False  # everything gathered for the user: the hooks stand aside
        # Backward has begun: a forward run inside it (activation checkpointing's
        # recomputation) gathers what it needs but frees nothing, since the modules
        # around it may still have their backward to run.
        self.in_backward = False
        self._handles = [
            module.register_state_dict_pre_hook(self._refuse_released),
            module.register_load_state_dict_pre_hook(self._refuse_released),
            module.register_load_state_dict_post_hook(self._after_load),
        ]
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) in self.bucket_of_param]
            if not own:
                continue
            for p in own:
                self.holders.setdefault(id(p), set()).add(id(m))
            self.buckets_of[id(m)] = tuple(sorted({self.bucket_of_param[id(p)] for p in own}))
            self._handles.append(m.register_forward_pre_hook(_eagerly(self._before_module)))
            self._handles.append(m.register_forward_hook(_eagerly(self._after_module)))

    # -- hooks ---------------------------------------------------------------------------

    def _before_module(self, module: nn.Module, args) -> None:
        if self.held:
            return
        self.running.append(module)
        if self.watched and not self.in_backward:
            needed = self.always.union(*(self.buckets_of[id(m)] for m in self.running))
            for b, resident in enumerate(self.sharded.resident):
                if resident and b not in needed:
                    self.sharded.release(b)
        for b in self.buckets_of[id(module)]:
            self.sharded.gather_bucket(b)

    def _after_module(self, module: nn.Module, args, output) -> None:
        if self.held:
            return
        self.running.pop()
        if not torch.is_grad_enabled():
            return
        buckets = self.buckets_of[id(module)]

        def gather_for_backward(grad: torch.Tensor) -> None:
            self.in_backward = True
            for b in buckets:
                self.sharded.gather_bucket(b)

        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(gather_for_backward)

    def after_reduction(self, bucket: int) -> None:
        """Bucket ``bucket``'s gradients are reduced: backward is done with its values."""
        if bucket not in self.always:
            self.sharded.release(bucket)

    # -- the user's own access to the module ---------------------------------------------

    def _refuse_released(self, module: nn.Module, *args) -> None:
        if not all(self.sharded.resident):
            raise UsageError(
                "DataParallel(shard='parameters') holds only this rank's shard of the "
                "weights between steps: call model.gather_parameters() on every rank before "
                "reading or loading model.module's state (model.state_dict() does it)")

    def _after_load(self, module: nn.Module, incompatible) -> None:
        self.sharded.keep_module_values()  # the loaded values are the shards' now

    def hold(self) -> None:
        """Gather everything (collective) and keep it until the next forward."""
        self.sharded.gather()
        self.held = True

    def release_all(self) -> None:
        self.held = False
        for b in range(len(self.sharded.flats)):
            self.sharded.release(b)

    # -- around the wrapped module's forward ----------------------------------------------

    def before_forward(self) -> None:
        """The buckets kept resident for good, gathered afresh (the optimizer may have
        stepped their shards since)."""
        for b in sorted(self.always):
            self.sharded.gather_bucket(b)

    def start_forward(self) -> None:
        """Before the wrapped module's forward."""
        self.in_backward = False
        self.running = []  # a forward that raised left its modules here
        if not self.watched:
            self.sharded.gather()  # the first forward runs with everything resident
            self._watch = _OutsideUses(self)
            self._watch.__enter__()

    def end_forward(self) -> None:
        """After the wrapped module's forward returned."""
        if not self.watched:
            self._watch.__exit__(None, None, None)
            self.watched = True
        if not torch.is_grad_enabled():  # no backward will need what is resident
            for b in range(len(self.sharded.flats)):
                if b not in self.always:
                    self.sharded.release(b)

    @contextlib.contextmanager
    def around_forward(self) -> Iterator[None]:
        _eagerly(self.start_forward)()
        try:
            yield
        except BaseException:
            if not self.watched:
                self._watch.__exit__(None, None, None)
            raise
        _eagerly(self.end_forward)()

    def note_use(self, tensor: torch.Tensor) -> None:
        holders = self.holders.get(id(tensor))
        if holders is None:
            return
        if not any(id(m) in holders for m in self.running):
            self.always.add(self.bucket_of_param[id(tensor)])


class _OutsideUses(TorchFunctionMode):
    """Records parameters passed to torch while no module holding them runs."""

    def __init__(self, gathering: LayerGathering):
        super().__init__()
        self.gathering = gathering

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, nn.Parameter):
                self.gathering.note_use(leaf)
        return func(*args, **kwargs)


def _eagerly(method):
    """``method`` run outside torch.compile's tracing (its collectives and bookkeeping
    are not graph material: a graph break, as DataParallel's own _before_forward)."""

    def run(*args, **kwargs):
        return method(*args, **kwargs)

    return torch._disable_dynamo(run)
