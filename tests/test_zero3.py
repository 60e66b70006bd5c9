"""DataParallel(shard="parameters"): ZeRO-3's gathering and releasing, seen from a rank.

(Its weights against shard="none", its clipping, state dicts and checkpoints are in
test_zero.py with the other modes.)

* during the forward of a layer, the only full parameters in memory are that layer's
  bucket; after a synchronized backward none are; backward gathers what it needs;
* a weight read outside its module (tied to another layer, used by the parent) is found
  by the first forward, kept in memory, and training stays bit for bit shard="none";
* the flat tensors are freed for real: their storage holds no bytes;
* model.module is refused while released and usable on one rank once gathered;
* activation checkpointing, unused branches, buffers, a float64 bucket, a static graph,
  evaluation between steps and torch.compile all keep shard="none"'s bits.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn


def _layers():
    # one bucket per layer at bucket_cap_mb=0.0038 (3984 bytes: each layer's weight
    # closes a bucket, and no bias alone does)
    return nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 64), nn.ReLU(),
                         nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 5))


def _batch(step, rank, n=6, features=64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, features, generator=g), torch.randint(0, 5, (n,), generator=g)


def run_residency(world):
    from ddpkit.parallel import DataParallel

    torch.manual_seed(3)
    ddp = DataParallel(_layers(), shard="parameters", bucket_cap_mb=0.0038)
    sharded = ddp._sharding.params
    layers = [m for m in ddp.module if isinstance(m, nn.Linear)]
    bucket_of = {id(m): ddp._sharding.layers.buckets_of[id(m)] for m in layers}
    seen = {"forward": [], "backward": []}

    def in_forward(module, args):
        seen["forward"].append((bucket_of[id(module)],
                                [b for b, r in enumerate(sharded.resident) if r]))

    def after_forward(module, args, output):
        # when backward reaches the layer's output, after the engine's hook on it
        output.register_hook(lambda grad: seen["backward"].append(
            (bucket_of[id(module)], [b for b, r in enumerate(sharded.resident) if r])))

    for m in layers:
        # registered after the engine's hooks: these run once its buckets are gathered
        m.register_forward_pre_hook(in_forward)
        m.register_forward_hook(after_forward)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    after_backward, bytes_after = [], []
    for step in range(3):
        seen["forward"].clear()
        seen["backward"].clear()
        opt.zero_grad()
        x, y = _batch(step, world.rank)
        F.cross_entropy(ddp(x), y).backward()
        after_backward.append([b for b, r in enumerate(sharded.resident) if r])
        bytes_after.append(sum(f.untyped_storage().nbytes() for f in sharded.flats))
        opt.step()
    return {"buckets": len(sharded.flats), "forward": seen["forward"],
            "backward": seen["backward"], "after_backward": after_backward,
            "bytes_after": bytes_after, "always": sorted(ddp._sharding.layers.always)}


def test_only_the_running_layer_is_gathered(pools):
    for r in pools(2).run(run_residency):
        assert r["buckets"] == 4  # one per layer: the gathering unit is the bucket
        assert r["always"] == []  # every weight is used inside its own layer
        # (the last step's trace: the first forward ran with everything resident)
        assert len(r["forward"]) == 4, r["forward"]
        for bucket, resident in r["forward"]:
            assert resident == list(bucket), (bucket, resident)
        for bucket, resident in r["backward"]:
            assert set(bucket) <= set(resident) and len(resident) <= 2, (bucket, resident)
        assert len(r["backward"]) == 4
        assert r["after_backward"] == [[], [], []]
        assert r["bytes_after"] == [0, 0, 0]


class Tied(nn.Module):
    """An embedding whose weight the output layer reuses, read by the parent's forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.hidden = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, tokens):
        h = torch.relu(self.hidden(self.embed(tokens).mean(1)))
        return F.linear(self.norm(h), self.embed.weight)  # the tied output layer


def run_tied(world, mode, compile_backend=None):
    from ddpkit.parallel import DataParallel

    torch.manual_seed(11)
    ddp = DataParallel(Tied(), shard=mode, bucket_cap_mb=0.004)
    model = ddp if compile_backend is None else torch.compile(ddp, backend=compile_backend)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + world.rank)
        tokens = torch.randint(0, 50, (8, 5), generator=g)
        target = torch.randint(0, 50, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(tokens), target).backward()
        opt.step()
    layers = ddp._sharding.layers if mode == "parameters" else None
    always = sorted(layers.always) if layers else []
    embed_bucket = ddp.reducer.bucket_of[ddp.reducer.names.index("embed.weight")]
    return [v.clone() for v in ddp.state_dict().values()], always, embed_bucket, \
        len(ddp.reducer.buckets)


def test_a_weight_read_outside_its_layer_stays_gathered(pools):
    expected = pools(2).run(run_tied, "none")
    got = pools(2).run(run_tied, "parameters")
    for (state, always, embed_bucket, buckets), (plain, *_) in zip(got, expected):
        assert buckets > 1
        assert always == [embed_bucket]
        assert all(torch.equal(a, b) for a, b in zip(state, plain))


def run_module_between_steps(world):
    from ddpkit.errors import UsageError
    from ddpkit.parallel import DataParallel

    torch.manual_seed(3)
    ddp = DataParallel(_layers(), shard="parameters", bucket_cap_mb=0.0038)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _batch(0, world.rank)
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
    try:
        ddp.module.state_dict()
        refused = None
    except UsageError as err:
        refused = str(err)
    ddp.gather_parameters()
    held = all(ddp._sharding.params.resident)
    out = None
    if world.rank == 0:  # alone: a held module runs with no collectives
        with torch.no_grad():
            out = ddp.module(_batch(9, 0)[0])
    weights = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    with torch.no_grad():
        through_engine = ddp(_batch(9, 0)[0])  # gathers the same values again
    released = not any(ddp._sharding.params.resident)
    return refused, held, out, through_engine, weights, released


def test_the_module_is_usable_between_steps_once_gathered(pools):
    results = pools(2).run(run_module_between_steps, timeout=60)
    for rank, (refused, held, out, through_engine, weights, released) in enumerate(results):
        assert refused is not None and "call model.gather_parameters() on every rank" in refused
        assert held and released
        if rank == 0:
            assert torch.equal(out, through_engine)
        assert all(torch.equal(weights[k], results[0][4][k]) for k in weights)


class Recomputed(nn.Module):
    """A parent whose own weight acts before a block that backward recomputes
    (torch.utils.checkpoint): the recomputation runs forward hooks inside backward, and
    the parent's weight is needed after it (for the gradient of ``inp``'s output)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 64))
        self.inp = nn.Linear(64, 64)
        self.block = nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 64))
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, self.inp(x) * self.scale, use_reentrant=False)
        return self.head(torch.relu(h))


def run_recomputed(world, mode):
    from ddpkit.parallel import DataParallel

    torch.manual_seed(5)
    ddp = DataParallel(Recomputed(), shard=mode, bucket_cap_mb=0.0038)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    for step in range(3):
        x, y = _batch(step, world.rank)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [v.clone() for v in ddp.state_dict().values()], len(ddp.reducer.buckets)


def test_activation_checkpointing_recomputes_with_the_gathered_weights(pools):
    expected = pools(2).run(run_recomputed, "none")
    got = pools(2).run(run_recomputed, "parameters")
    for (state, buckets), (plain, _) in zip(got, expected):
        assert buckets == 4  # [head, block.2], [block.0], [inp], [scale]
        assert all(torch.equal(a, b) for a, b in zip(state, plain))


class Branchy(nn.Module):
    """BatchNorm buffers, a float64 layer (a bucket of its own dtype) and a branch that
    some steps skip (every rank alike)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 200)
        self.norm = nn.BatchNorm1d(200)
        self.skip = nn.Linear(200, 200)
        self.wide = nn.Linear(200, 8).double()
        self.out = nn.Linear(8, 5)

    def forward(self, x, use_skip):
        h = torch.relu(self.norm(self.inp(x)))
        if use_skip:
            h = h + self.skip(h)
        return self.out(self.wide(h.double()).float())


def run_branchy(world, mode, find_unused, static_graph):
    from ddpkit.parallel import DataParallel

    torch.manual_seed(9)
    ddp = DataParallel(Branchy(), shard=mode, bucket_cap_mb=0.0038,
                       find_unused_parameters=find_unused, static_graph=static_graph)
    # AdamW with weight decay: a parameter no rank used must be skipped (its .grad None)
    # with its own step count, as unsharded, or its weights and moments would move
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
    evals = []
    for step in range(4):
        x, y = _batch(step, world.rank, n=8)
        ddp.train()
        opt.zero_grad()
        F.cross_entropy(ddp(x, use_skip=step % 2 == 0 or not find_unused), y).backward()
        opt.step()
        ddp.eval()  # an evaluation between steps, through the engine, no grad
        with torch.no_grad():
            evals.append(ddp(_batch(50, 0, n=8)[0], use_skip=True).clone())
    return [v.clone() for v in ddp.state_dict().values()], evals


@pytest.mark.parametrize("find_unused,static_graph", [(True, False), (False, True)])
def test_unused_branches_buffers_dtypes_and_evaluation_match_unsharded(pools, find_unused,
                                                                      static_graph):
    expected = pools(2).run(run_branchy, "none", find_unused, static_graph)
    modes = ("optimizer", "gradients", "parameters") if find_unused else ("parameters",)
    for mode in modes:
        got = pools(2).run(run_branchy, mode, find_unused, static_graph)
        for (state, evals), (plain, plain_evals) in zip(got, expected):
            assert len(state) == len(plain) == 13  # 10 parameters and BatchNorm's 3 buffers
            assert all(torch.equal(a, b) for a, b in zip(state, plain)), mode
            assert all(torch.equal(a, b) for a, b in zip(evals, plain_evals)), mode


def test_torch_compile_gathers_outside_the_compiled_graphs(pools):
    # The hooks' gathers run eagerly (graph breaks); the first forward's watch still
    # finds the tied weight while dynamo traces the model under it. aot_eager: dynamo's
    # tracing and graph breaks, as under inductor, without its kernel builds (what is
    # checked here is where the gathers run, not the kernels).
    expected = pools(2).run(run_tied, "none", "aot_eager", timeout=300)
    got = pools(2).run(run_tied, "parameters", "aot_eager", timeout=300)
    for (state, always, embed_bucket, _), (plain, *_) in zip(got, expected):
        assert always == [embed_bucket]
        assert all(torch.equal(a, b) for a, b in zip(state, plain))
