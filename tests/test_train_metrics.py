"""Metrics are reduced exactly across ranks, padded samples never count, and W ranks
train like one process (gloo ranks from the session pool)."""

import math

import pytest
import torch
import torch.nn.functional as F

from ddpkit.train.config import Config
from ddpkit.train.metrics import MetricSums
from ddpkit.train.models import builtin_model

N_TRAIN = 1001  # 1001 = 20 x 48 + 41: the last global batch is uneven and padded


def _uneven_sums(world):
    # rank r holds r + 1 samples, each with loss r + 1; rank 0 gets every prediction right.
    sums = MetricSums()
    n = world.rank + 1
    sums.add(torch.full((n,), float(world.rank + 1)), torch.full((n,), world.rank == 0))
    mine, total = sums.local(), sums.reduce()
    return [mine.loss, total.loss, total.accuracy, total.count]


def test_metric_sums_reduce_exactly_with_uneven_counts(pools):
    results = pools(3).run(_uneven_sums)
    # global mean over 1 + 2 + 3 samples: (1*1 + 2*2 + 3*3) / 6; a mean of rank means is 2
    for r, (mine, loss, acc, count) in enumerate(results):
        assert mine == r + 1
        assert loss == 14 / 6 and acc == 1 / 6 and count == 6


def _config(**train):
    return Config.from_dict({
        "data": {"name": "synthetic", "synthetic_size": N_TRAIN},
        "train": {"batch_size": 48, "epochs": 1, "engine": "torch", "eval_batch_size": 100,
                  "threads": 1, **train}})


def _train_one_epoch(world, cfg_dict):
    from ddpkit.train.trainer import Trainer, unwrap

    trainer = Trainer(Config.from_dict(cfg_dict), world, write=False)
    record = trainer.train_epoch()
    record.update(trainer.evaluate())
    params = [p.detach().clone() for p in unwrap(trainer.model).parameters()]
    return record, params if world.is_main else None


@pytest.fixture(scope="module")
def one_epoch(pools):
    cfg = _config().to_dict()
    return {w: pools(w).run(_train_one_epoch, cfg) for w in (1, 3)}


def test_train_metrics_count_every_real_sample_once(one_epoch):
    for world, results in one_epoch.items():
        records = [rec for rec, _ in results]
        reduced = ("train_loss", "train_acc", "train_samples", "rank_train_loss", "test_loss",
                   "test_acc", "test_samples")
        assert all({k: rec[k] for k in reduced} == {k: records[0][k] for k in reduced}
                   for rec in records), "every rank reports the same totals"
        rec = records[0]
        assert rec["train_samples"] == N_TRAIN, world
        assert sum(rec["rank_train_samples"]) == N_TRAIN
        assert len(rec["rank_train_loss"]) == world
        # Per-rank losses weighted by per-rank counts give the global loss.
        pairs = zip(rec["rank_train_loss"], rec["rank_train_samples"], strict=True)
        weighted = sum(loss * n for loss, n in pairs) / N_TRAIN
        assert weighted == pytest.approx(rec["train_loss"], rel=1e-12)
    # 3 ranks took the same steps as 1 process, so the metrics match up to rounding.
    one, three = one_epoch[1][0][0], one_epoch[3][0][0]
    assert three["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    assert abs(three["train_acc"] - one["train_acc"]) <= 1 / N_TRAIN


def test_test_metrics_equal_a_direct_computation(one_epoch):
    from ddpkit.data import load_dataset

    _, test = load_dataset("synthetic", synthetic_size=N_TRAIN)
    assert len(test) % 3 and len(test) % 100  # uneven shards and an uneven last batch
    for world, results in one_epoch.items():
        rec, params = results[0]
        model = builtin_model("mlp", test.input_shape, test.num_classes)
        with torch.no_grad():
            for p, q in zip(model.parameters(), params, strict=True):
                p.copy_(q)
            out = model(test.x)
        losses = F.nll_loss(out, test.y, reduction="none").double()
        assert rec["test_samples"] == len(test)
        assert rec["test_loss"] == pytest.approx(losses.mean().item(), rel=1e-6), world
        assert rec["test_acc"] == (out.argmax(1) == test.y).double().mean().item(), world
        assert not math.isnan(rec["samples_per_s"])


def test_same_seed_same_run_on_cpu(pools, one_epoch):
    again = pools(3).run(_train_one_epoch, _config().to_dict())
    assert again[0][0]["train_loss"] == one_epoch[3][0][0]["train_loss"]
    for a, b in zip(again[0][1], one_epoch[3][0][1], strict=True):
        assert torch.equal(a, b)
