"""BatchNorm with running statistics in exact mode: a ResNet-style model trains to the
same parameters *and buffers* at W = 1..4, and the running statistics are the global
batch's, folded once a step (docs/exact.md, "BatchNorm and other buffers")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_exact import _restoring, _same

V, BATCH, STEPS = 12, 24, 3


class _Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class _ResNet(nn.Module):
    """A stem, one residual block, pooled features through a BatchNorm1d with the
    cumulative average (momentum=None), a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(8), nn.ReLU())
        self.block = _Block(8)
        self.features = nn.BatchNorm1d(8, momentum=None)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.block(self.stem(x)).mean(dim=(2, 3))
        return self.head(self.features(h))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 3, 8, 8, generator=g) * 2 + 0.5,
            torch.randint(0, 4, (BATCH,), generator=g))


def _train(world, steps: int = STEPS):
    """SGD with momentum on the ResNet; its state (parameters and buffers) after each
    step, and the eval-mode output of the last."""
    import ddpkit

    torch.manual_seed(0)
    model = ddpkit.DataParallel(_ResNet(), exact=True, slices=V)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    r, w = world.rank, world.world_size
    states = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        for xs, ys in model.slices(x[r::w], y[r::w]):
            F.cross_entropy(model(xs), ys).backward()
        opt.step()
        states.append([t.detach().clone() for t in model.module.state_dict().values()])
    model.module.eval()
    with torch.no_grad():
        out = model.module(_batch(99)[0])
    return {"states": states, "eval": out}


@pytest.fixture(scope="module")
def one_process(pools):
    return pools(1).run(_restoring, _train)[0]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_resnet_with_batchnorm_ends_with_the_same_parameters_and_buffers(pools, one_process,
                                                                         world):
    for r in pools(world).run(_restoring, _train):
        for step, (mine, ref) in enumerate(zip(r["states"], one_process["states"],
                                               strict=True)):
            assert _same(mine, ref), step
        assert torch.equal(r["eval"], one_process["eval"])


def test_running_statistics_are_the_global_batch_folded_once_a_step(one_process):
    """After one step, the stem's BatchNorm holds 0.9 * init + 0.1 * the global batch's
    statistics of its input (computed here from the initial weights), and every
    num_batches_tracked counts steps."""
    torch.manual_seed(0)
    net = _ResNet()
    names = list(net.state_dict())
    with torch.no_grad():
        h = net.stem[0](_batch(0)[0])
    var, mean = torch.var_mean(h, dim=(0, 2, 3), correction=1)
    first = dict(zip(names, one_process["states"][0], strict=True))
    torch.testing.assert_close(first["stem.1.running_mean"], 0.1 * mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(first["stem.1.running_var"], 0.9 + 0.1 * var, rtol=1e-5,
                               atol=1e-6)
    last = dict(zip(names, one_process["states"][-1], strict=True))
    counters = [n for n in names if n.endswith("num_batches_tracked")]
    assert len(counters) == 4 and all(int(last[n]) == STEPS for n in counters)
    # momentum=None: after the first step the cumulative average is that step's statistic
    assert not torch.equal(first["features.running_mean"], torch.zeros(8))


def _folded_by_simulated_ranks(world: int, slices: list[torch.Tensor]) -> nn.BatchNorm1d:
    """One step of a BatchNorm1d over ``slices`` (global slice order) run by ``world``
    simulated ranks in this process (rank r: slices r, r + world, ...), their rows
    gathered in rank order as the collective does; rank 0's layer afterwards."""
    from ddpkit.parallel.exact.running_stats import SliceRunningStats

    ranks = []
    for r in range(world):
        layer, current = nn.BatchNorm1d(slices[0].shape[1]), [None]
        stats = SliceRunningStats(layer, lambda current=current: current[0])
        local = slices[r::world]
        stats.begin(len(local), torch.device("cpu"))
        for m, xs in enumerate(local):
            current[0] = m
            layer(xs)
        current[0] = None
        ranks.append((layer, stats))

    def gather(output, _input):
        output.copy_(torch.cat([stats.rows.reshape(-1) for _, stats in ranks]))

    for r, (_, stats) in enumerate(ranks):
        stats.update(r, world, gather)
    return ranks[0][0]


def test_slice_statistics_are_folded_in_slice_order_whoever_ran_them():
    """Slice means 1, -1 and 2^-60 on a channel (their sum depends on the order of the
    additions: 1 + 2^-60 rounds to 1) give the same running statistics at W = 1..4, and
    adding them in rank order would not."""
    g = torch.Generator().manual_seed(3)
    means = torch.zeros(V, 64)
    for c in range(64):
        a, b, k = torch.randperm(V, generator=g)[:3].tolist()
        means[a, c], means[b, c], means[k, c] = 1.0, -1.0, 2.0 ** -60
    slices = [torch.stack([row, row]) for row in means]  # 2 samples: mean = the row
    one = _folded_by_simulated_ranks(1, slices)
    assert one.running_mean.abs().max() > 0  # some channel kept its 2^-60
    for w in (2, 3, 4):
        layer = _folded_by_simulated_ranks(w, slices)
        assert torch.equal(layer.running_mean, one.running_mean), w
        assert torch.equal(layer.running_var, one.running_var), w
        in_rank_order = [xs for r in range(w) for xs in slices[r::w]]
        other = _folded_by_simulated_ranks(1, in_rank_order)
        assert not torch.equal(other.running_mean, one.running_mean), w


def _misuse(world):
    import ddpkit

    def message(fn):
        try:
            fn()
        except ddpkit.DdpkitError as err:
            return str(err)
        return None

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.bn(self.fc(x)))

    model = ddpkit.DataParallel(Twice(), exact=True, slices=2)

    def step():
        for xs in model.slices(torch.randn(4, 4)):
            model(xs).sum().backward()

    return {"twice": message(step),
            "instance": message(lambda: ddpkit.DataParallel(
                nn.Sequential(nn.Conv1d(2, 2, 1), nn.InstanceNorm1d(2, track_running_stats=True)),
                exact=True, slices=2))}


def test_what_running_statistics_exact_mode_still_refuses_is_one_line(pools):
    out = pools(1).run(_restoring, _misuse)[0]
    assert out["twice"] is not None and "BatchNorm 'bn' ran twice in one slice" in out["twice"]
    assert out["instance"] is not None and out["instance"].startswith(
        "exact mode: InstanceNorm1d '1' updates running statistics")
