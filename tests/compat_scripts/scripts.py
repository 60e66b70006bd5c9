"""Ordinary torch DDP training scripts, each written for torch's DistributedDataParallel.

Each ``script(DDP)`` is what a user's program looks like after
``from torch.nn.parallel import DistributedDataParallel as DDP``; the compatibility
tests run it once with torch's class and once with ``ddpkit.DataParallel`` in its
place (the one-line import change) and compare the final parameters bit for bit. The
process group is already initialized (2 or 3 gloo ranks); each returns its model's
state.
"""

from __future__ import annotations

import copy
import io
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _rank() -> int:
    return dist.get_rank()


def _batch(step: int, n: int = 8, dim: int = 16, classes: int = 4):
    g = torch.Generator().manual_seed(1000 * step + _rank())
    return torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def accumulate_no_sync(DDP):
    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        for micro in range(3):
            x, y = _batch(10 * step + micro)
            if micro < 2:
                with model.no_sync():
                    F.cross_entropy(model(x), y).backward()
            else:
                F.cross_entropy(model(x), y).backward()
        opt.step()
    return _state(model)


def accumulate_require_backward_grad_sync(DDP):
    model = DDP(_mlp(), device_ids=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        for micro in range(3):
            model.require_backward_grad_sync = micro == 2
            x, y = _batch(10 * step + micro)
            (F.cross_entropy(model(x), y) / 3).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _state(model.module)


def adamw_clip_scheduler(DDP):
    model = DDP(_mlp(), None, None, 0, True)  # torch's positional arguments
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=6)
    for step in range(6):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
    return _state(model)


def bf16_autocast(DDP):
    model = DDP(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(4):
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _state(model)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, ctx: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("mask", torch.tril(torch.ones(ctx, ctx)).bool(), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A 2-layer GPT; the output head shares the token embedding's weight (tied)."""

    def __init__(self, vocab: int = 50, d: int = 32, ctx: int = 16, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, ctx, d))
        self.blocks = nn.Sequential(*[_Block(d, 4, ctx) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def gpt_tied_weights(DDP):
    torch.manual_seed(0)
    model = DDP(TinyGPT())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + _rank())
        idx = torch.randint(0, 50, (4, 17), generator=g)
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 50), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.module.head.weight is model.module.tok.weight
    return _state(model)


def cnn_batchnorm(DDP):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 2 * 2, 4))
    model = DDP(net, broadcast_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        g = torch.Generator().manual_seed(step * 10 + _rank())
        x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _state(model)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(16, 16)
        self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.trunk(x))
        return self.b(h) if use_b else self.a(h)


def unused_parameters(DDP):
    model = DDP(_Branchy(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x, use_b=(step + _rank()) % 2 == 0), y).backward()
        opt.step()
    return _state(model)


def uneven_inputs_join(DDP):
    from torch.distributed.algorithms.join import Join

    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [_batch(step) for step in range(3 + 2 * _rank())]
    with Join([model]):
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return _state(model)


def uneven_inputs_join_mean_of_active_ranks(DDP):
    from torch.distributed.algorithms.join import Join

    model = DDP(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = [_batch(step) for step in range(2 + 3 * _rank())]
    with Join([model], divide_by_initial_world_size=False):
        for i, (x, y) in enumerate(batches):
            if i % 2 == 0:
                with model.no_sync():
                    F.cross_entropy(model(x), y).backward()
            else:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    return _state(model)


def uneven_inputs_join_zero_optimizer(DDP):
    """torch's Join over the model and a ZeroRedundancyOptimizer (both Joinable): the
    rank that runs out of batches keeps answering the optimizer's parameter broadcasts."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = DDP(_mlp())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    batches = [_batch(step) for step in range(3 + 2 * _rank())]
    with Join([model, opt]):
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return _state(model)


def _with_hook(DDP, make_hook):
    model = DDP(_mlp())
    state, hook = make_hook()
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _state(model)


def hook_allreduce(DDP):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return _with_hook(DDP, lambda: (None, default_hooks.allreduce_hook))


def hook_fp16_compress(DDP):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return _with_hook(DDP, lambda: (None, default_hooks.fp16_compress_hook))


def hook_powersgd(DDP):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    def make():
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.5)
        return state, powerSGD.powerSGD_hook

    return _with_hook(DDP, make)


def _bn_net(fill: str) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        getattr(net[1], fill).fill_(1.0 + _rank())  # rank-local before wrapping
    return net


def buffer_arguments(DDP):
    """torch 2.13's two buffer arguments: broadcast_buffers=False keeps rank-local
    buffers at construction too; given both, forward_sync_buffers wins (torch warns)."""
    import warnings

    states = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of the old name
        for name, kwargs in {
            "local": {"broadcast_buffers": False},
            "both": {"broadcast_buffers": False, "forward_sync_buffers": True},
            "forward": {"forward_sync_buffers": False},
        }.items():
            model = DDP(_bn_net("running_mean"), **kwargs)
            _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
            states.update({f"{name}.{k}": v for k, v in _state(model).items()})
    return states


def hook_registered_after_training(DDP):
    """torch lets a comm hook be registered once training has begun; so does ddpkit."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, 2)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    _train(model, opt, 2, first_step=2)
    return _state(model)


def compiled(DDP):
    model = torch.compile(DDP(_mlp()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k.removeprefix("_orig_mod."): v.detach().clone()
            for k, v in model.state_dict().items()}


def _train(model, opt, steps, first_step=0, **forward_kwargs):
    for step in range(first_step, first_step + steps):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x, **forward_kwargs), y).backward()
        opt.step()


def pickled_midway(DDP):
    """torch.save(ddp_model) then torch.load, and training goes on with the copy."""
    model = DDP(_mlp())
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _train(loaded, torch.optim.SGD(loaded.parameters(), lr=0.1), 2, first_step=2)
    return _state(loaded)


def deepcopied_midway(DDP):
    """copy.deepcopy(ddp_model): the copy trains on, and so does the original."""
    model = DDP(_mlp())
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    twin = copy.deepcopy(model)
    _train(twin, torch.optim.SGD(twin.parameters(), lr=0.05), 2, first_step=2)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, first_step=4)
    return {**{f"twin.{k}": v for k, v in _state(twin).items()}, **_state(model)}


class _Bag(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 8, sparse=sparse)
        self.out = nn.Linear(8, 4)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(dim=1))


def sparse_embedding(DDP):
    """nn.Embedding(sparse=True): the sparse gradient is all-reduced, SGD applies it."""
    model = DDP(_Bag(sparse=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + _rank())
        tokens = torch.randint(0, 40, (6, 5), generator=g)  # repeats: uncoalesced rows
        y = torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(tokens), y).backward()
        opt.step()
    return _state(model)


def sparse_embedding_uneven_inputs(DDP):
    """Sparse gradients under model.join(): a rank that ran out of batches answers the
    others' sparse all-reduces with empty gradients."""
    model = DDP(_Bag(sparse=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with model.join():
        for step in range(2 + 2 * _rank()):
            g = torch.Generator().manual_seed(100 * step + _rank())
            tokens = torch.randint(0, 40, (6, 5), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(tokens), torch.randint(0, 4, (6,), generator=g)).backward()
            opt.step()
    return _state(model)


def _grad_presence(model) -> dict[str, torch.Tensor]:
    return {f"grad_is_none.{n}": torch.tensor(p.grad is None)
            for n, p in model.module.named_parameters()}


def static_graph_unused(DDP):
    """static_graph=True and a layer that no iteration uses (its .grad stays None)."""
    model = DDP(_Branchy(), static_graph=True)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 4, use_b=False)
    return {**_state(model), **_grad_presence(model)}


def static_graph_set_after_construction(DDP):
    model = DDP(_Branchy())
    model._set_static_graph()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 3, use_b=True)
    return {**_state(model), **_grad_presence(model)}


def join_method_uneven_inputs(DDP):
    """torch DDP's own method: ``with model.join(): ...``, and its arguments."""
    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join(enable=False):
        _train(model, opt, 1, first_step=20)
    with model.join():
        _train(model, opt, 2 + _rank())
    # Last: after a divide_by_initial_world_size=False join, torch 2.13's reducer keeps
    # that join's final divisor for a later join(enable=False) block (docs/ddp-engine.md).
    with model.join(divide_by_initial_world_size=False):
        _train(model, opt, 3 - _rank() % 2, first_step=10)
    return _state(model)


def batchnorm_no_sync_and_eval(DDP):
    """Buffers are broadcast before a forward only if the previous forward synchronized
    (torch's require_forward_param_sync): no_sync and no_grad forwards change what the
    next forward broadcasts, so the ranks' running statistics depend on it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        with model.no_sync():
            F.cross_entropy(model(x), y).backward()
        x, y = _batch(step + 50)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(_batch(step + 90)[0])
            model(_batch(step + 91)[0])
    model.eval()
    with torch.no_grad():
        model(_batch(7)[0])
    return _state(model)


def hook_wrappers_and_builtin_registration(DDP):
    """torch's hook wrappers and registration helpers: fp16_compress_wrapper swaps a
    half-precision buffer into the bucket (GradBucket.set_buffer) for the wrapped hook;
    a hook registered through register_ddp_comm_hook, on a model of its own."""
    from torch.distributed.algorithms.ddp_comm_hooks import (
        DDPCommHookType,
        default_hooks,
        register_ddp_comm_hook,
    )

    states = _with_hook(DDP, lambda: (None, default_hooks.fp16_compress_wrapper(
        default_hooks.allreduce_hook)))
    model = DDP(_mlp())
    register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, model)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 3)
    states.update({f"registered.{k}": v for k, v in _state(model).items()})
    return states


class _Alternating(nn.Module):
    """Branch b or c, by step and rank: the set of used parameters changes every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 4), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, step=0):
        return self.a(x) + (self.b(x) if step % 2 else self.c(x))


def unused_parameters_changing_graph(DDP):
    """find_unused_parameters=True with a graph that changes every step and differs
    between ranks; momentum makes a .grad of None (skipped) differ from zeros. Small
    buckets: torch never re-lays them with find_unused_parameters, so at three ranks only
    torch's own layout gives torch's sums."""
    model = DDP(_Alternating(), find_unused_parameters=True, bucket_cap_mb=0.0003)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    unused = []
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(step)
        F.cross_entropy(model(x, step=step + _rank() * (step > 2)), y).backward()
        unused.append([p.grad is None for p in model.parameters()])
        opt.step()
    return {**_state(model), "unused": torch.tensor(unused)}


def nested_no_sync_bucket_views_subgroup(DDP):
    """no_sync nested in no_sync, gradient_as_bucket_view with zero_grad keeping the
    gradients (set_to_none=False), tiny buckets, on a process group of its own."""
    group = dist.new_group(list(range(dist.get_world_size())))
    model = DDP(_mlp(), process_group=group, bucket_cap_mb=0.001,
                gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    flags = []
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        with model.no_sync():
            with model.no_sync():
                x, y = _batch(step)
                F.cross_entropy(model(x), y).backward()
            flags.append(model.require_backward_grad_sync)
            x, y = _batch(step + 10)
            F.cross_entropy(model(x), y).backward()
        flags.append(model.require_backward_grad_sync)
        x, y = _batch(step + 20)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {**_state(model), "flags": torch.tensor(flags)}


SCRIPTS = {f.__name__: f for f in (
    accumulate_no_sync, accumulate_require_backward_grad_sync, adamw_clip_scheduler,
    bf16_autocast, gpt_tied_weights, cnn_batchnorm, unused_parameters, uneven_inputs_join,
    uneven_inputs_join_mean_of_active_ranks, uneven_inputs_join_zero_optimizer,
    hook_allreduce, hook_fp16_compress, hook_powersgd, pickled_midway, deepcopied_midway,
    sparse_embedding, static_graph_unused, static_graph_set_after_construction,
    join_method_uneven_inputs, batchnorm_no_sync_and_eval, hook_registered_after_training,
    buffer_arguments, sparse_embedding_uneven_inputs, hook_wrappers_and_builtin_registration,
    unused_parameters_changing_graph, nested_no_sync_bucket_views_subgroup,
)}
