"""The training recipe options (train/recipe.py): each one changes what it should.

--model/--data package.module:factory train the user's module on the user's data;
--optimizer adamw takes Adam's steps, not SGD's; --lr-schedule cosine with --warmup-steps
sets the learning rate of every step; --grad-accum N at batch B is one step at batch N*B
(also on 2 ranks, padding included); --clip-grad-norm clips; --precision bf16 runs the
forward in bf16. Bad values are one line and exit 2.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddpkit import cli
from ddpkit.errors import ConfigError
from ddpkit.train import recipe
from ddpkit.train.config import resolve

BASE = {"data": "synthetic", "synthetic_size": 256, "batch_size": 64, "epochs": 1,
        "threads": 1, "progress": False, "hidden": [16]}


def _trainer(**over):
    from ddpkit.runtime.world import World
    from ddpkit.train.trainer import Trainer

    cfg = resolve({**BASE, **over})
    # One process, no process group: no engine needed.
    return Trainer(cfg, World(), write=False, wrap=lambda module, engine, device: module)


def _params(trainer):
    from ddpkit.train.trainer import unwrap

    return [p.detach().clone() for p in unwrap(trainer.model).parameters()]


def _one_step(trainer):
    """Parameters before, gradients and parameters after the first optimizer step."""
    from ddpkit.train.metrics import MetricSums

    before = _params(trainer)
    group = next(recipe.accumulation_groups(trainer.sampler.batches(),
                                            trainer.cfg.train.grad_accum))
    trainer.train_step(group, MetricSums())
    grads = [p.grad.detach().clone() for p in trainer.model.parameters()]
    return before, grads, _params(trainer)


def test_user_factories_train_the_users_module_on_the_users_data():
    t = _trainer(model="user_recipe:make_model", data="user_recipe:make_data", epochs=4,
                 batch_size=32)
    assert type(t.model).__name__ == "TwoLayer"
    assert (len(t.train_set), len(t.test_set), t.train_set.num_classes) == (240, 60, 3)
    summary = t.fit()
    assert summary["final_test_acc"] > 0.9
    assert recipe.short_name("user_recipe:make_model") == "make_model"


@pytest.mark.parametrize("over,match", [
    ({"model": "user_recipe:not_a_model"}, "returned str, not a torch.nn.Module"),
    ({"model": "user_recipe:missing"}, "module user_recipe has no missing"),
    ({"data": "user_recipe:make_model"}, "needs input_shape, num_classes, which ddpkit does "
                                          "not pass; it may take any of: data_dir"),
    ({"data": "user_recipe:not_a_model"}, "needs input_shape, num_classes"),
])
def test_a_factory_that_is_not_one_is_a_config_error(over, match):
    with pytest.raises(ConfigError) as err:
        _trainer(**over)
    assert match in str(err.value) and "\n" not in str(err.value)


def test_adamw_takes_adams_steps_and_sgd_its_own():
    lr = 0.01
    before, grads, after = _one_step(_trainer(optimizer="sgd", lr=lr, momentum=0.9))
    for b, g, a in zip(before, grads, after, strict=True):
        assert torch.allclose(a, b - lr * g, atol=1e-7)  # SGD's first step: -lr * grad
    t = _trainer(optimizer="adamw", lr=lr)
    assert isinstance(t.optimizer, torch.optim.AdamW)
    before, grads, after = _one_step(t)
    # (where |grad| >> Adam's eps, 1e-8)
    moved = [(a - b).abs()[g.abs() > 1e-4] for b, g, a in zip(before, grads, after, strict=True)]
    assert sum(m.numel() for m in moved) > 100
    # Adam's first step is lr * m / sqrt(v) = lr * sign(grad) for every element.
    assert all(torch.allclose(m, torch.full_like(m, lr), rtol=1e-3) for m in moved)


def test_cosine_schedule_with_warmup_sets_every_steps_learning_rate():
    peak, warmup = 0.2, 3
    t = _trainer(lr=peak, lr_schedule="cosine", warmup_steps=warmup, epochs=2)
    seen = []
    t.step_callbacks.append(lambda tr: seen.append(tr.optimizer.param_groups[0]["lr"]))
    t.fit()
    total = 2 * 256 // 64
    assert t.total_steps == total == len(seen)
    want = [peak * (k + 1) / warmup if k < warmup else
            peak * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))
            for k in range(total)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert seen[warmup] == peak and seen[-1] < 0.1 * peak
    flat = _trainer(lr=peak)
    flat_seen = []
    flat.step_callbacks.append(lambda tr: flat_seen.append(tr.optimizer.param_groups[0]["lr"]))
    flat.fit()
    assert flat_seen == [peak] * 4


def _accumulated(world, batch, accum, size):
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer, unwrap

    cfg = resolve({**BASE, "synthetic_size": size, "batch_size": batch, "grad_accum": accum,
                   "epochs": 1})
    plain = None if world.world_size > 1 else (lambda module, engine, device: module)
    trainer = Trainer(Config.from_dict(cfg.to_dict()), world, write=False, wrap=plain)
    trainer.fit()
    return trainer.run.step, [p.detach().clone() for p in unwrap(trainer.model).parameters()]


@pytest.mark.parametrize("size", [256, 300])  # 300: a partial last group, padded batches
def test_grad_accum_n_at_batch_b_is_one_step_at_batch_n_times_b(pools, size):
    from ddpkit.runtime.world import World

    steps_a, a = _accumulated(World(), 32, 4, size)
    steps_b, b = _accumulated(World(), 128, 1, size)
    assert steps_a == steps_b == math.ceil(size / 128)
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))
    # Two ranks (the engine skips the all-reduce on all but each step's last batch) take
    # the same steps as one process.
    for steps, params in pools(2).run(_accumulated, 32, 4, size):
        assert steps == steps_a
        assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6)
                   for x, y in zip(params, a, strict=True))


def test_clip_grad_norm_clips_the_step():
    def update_norm(**over):
        before, grads, after = _one_step(_trainer(momentum=0.0, lr=1.0, **over))
        grad_norm = torch.cat([g.flatten() for g in grads]).norm().item()
        moved = torch.cat([(a - b).flatten() for a, b in zip(after, before, strict=True)])
        return moved.norm().item(), grad_norm

    free, grad_norm = update_norm()
    assert free == pytest.approx(grad_norm, rel=1e-4) and grad_norm > 0.01
    clipped, clipped_grad = update_norm(clip_grad_norm=1e-3)
    assert clipped == pytest.approx(1e-3, rel=1e-3)
    assert clipped_grad == pytest.approx(1e-3, rel=1e-3)  # the gradients themselves


def test_bf16_runs_the_forward_in_bf16_and_trains():
    dtypes = {"bf16": set(), "fp32": set()}

    def run(precision):
        t = _trainer(precision=precision, epochs=2)
        linear = next(m for m in t.model.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda m, i, out: dtypes[precision].add(out.dtype))
        summary = t.fit()
        return summary, _params(t)

    bf16, p16 = run("bf16")
    fp32, p32 = run("fp32")
    assert dtypes == {"bf16": {torch.bfloat16}, "fp32": {torch.float32}}  # train and test
    assert math.isfinite(bf16["final_train_loss"])
    assert bf16["final_train_loss"] < 1.5 * fp32["final_train_loss"] + 0.1
    assert not all(torch.equal(a, b) for a, b in zip(p16, p32, strict=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused only without CUDA")
def test_fp16_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="--precision fp16 needs CUDA"):
        _trainer(precision="fp16")


def test_lr_at_is_the_schedule():
    assert recipe.lr_at(0, 1.0, "constant", 0, 10) == 1.0
    assert recipe.lr_at(0, 1.0, "constant", 4, 10) == 0.25
    assert recipe.lr_at(4, 1.0, "cosine", 4, 10) == 1.0
    assert recipe.lr_at(7, 1.0, "cosine", 4, 10) == pytest.approx(0.5)
    assert recipe.lr_at(10, 1.0, "cosine", 4, 10) == pytest.approx(0.0)
    assert recipe.steps_per_epoch(300, 32, 4) == 3 and recipe.steps_per_epoch(300, 32, 4, True) == 3
    assert list(recipe.accumulation_groups(range(5), 2)) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("argv,match", [
    (["--optimizer", "adam"], "--optimizer: invalid choice: 'adam'"),
    (["--lr-schedule", "step"], "--lr-schedule: invalid choice: 'step'"),
    (["--precision", "fp8"], "--precision: invalid choice: 'fp8'"),
    (["--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["--grad-accum", "two"], "--grad-accum: invalid int value: 'two'"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--model", "resnet"], "--model 'resnet' is not one of mlp, net, toy, nor package.module"),
    (["--model", "no_such_module_here:make"], "no module no_such_module_here"),
    (["--data", "no_such_module_here:make"], "no module no_such_module_here"),
])
def test_bad_recipe_values_are_one_line_and_exit_2(capsys, tmp_path, argv, match):
    try:
        code = cli.main(["train", "--out-dir", str(tmp_path / "runs"), *argv])
    except SystemExit as exc:  # argparse's own refusals (types, choices)
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("ddpkit train: error: ") and "\n" not in err, err
    assert match in err
    assert not (tmp_path / "runs").exists()
