"""Exact mode on pooled ranks: the same bits at every world size, and across a resume
that changes it.

Two programs: the main job (``Trainer`` on digits, global batch 96 = 12 slices)
and a user's own loop around ``DataParallel(model, exact=True)`` with dropout. Each
runs at W = 1 (the reference) and at other world sizes (2 and 3 for the main job, 2, 3
and 4 for the loop); the final parameters must be ``torch.equal``. The default mode on
the same program is *not* bit-identical across world sizes (checked too, so the
equality is not vacuous).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.train.config import resolve

MAIN = resolve({"batch_size": 96, "epochs": 1, "exact": True, "progress": False,
                "hidden": [64]}).to_dict()  # digits: 15 steps, the last one padded
DROPOUT = resolve({"data": "synthetic", "synthetic_size": 300, "batch_size": 96, "epochs": 2,
                   "model": "user_recipe:make_dropout_model", "exact": True,
                   "progress": False, "checkpoint_every_steps": 2,
                   "log_sample_ids": True}).to_dict()  # 4 steps per epoch


def _trainer_params(world, cfg_dict, run_dir=None, stop_at=None, restore=False):
    """Train with the Trainer (to the end, or until rank 0 asks for a stop after
    ``stop_at``); the final parameters and what the run logged."""
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer, unwrap

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("ddpkit")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        trainer = Trainer(Config.from_dict(cfg_dict), world, run_dir=run_dir,
                          write=run_dir is not None)
        if stop_at is not None and world.rank == 0:
            trainer.step_callbacks.append(
                lambda t: t.preemption.request() if t.run.step == stop_at else None)
        if restore:
            trainer.restore(required=True)
        trainer.fit()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"params": [p.detach().clone() for p in unwrap(trainer.model).parameters()],
            "step": trainer.run.step, "preempted": trainer.preempted, "log": lines}


def _restoring(world, fn, *args):
    """Run ``fn(world, *args)`` on a pooled rank, then put back the process-wide settings
    exact mode pins (deterministic algorithms, threads), for the tests that follow."""
    try:
        return fn(world, *args)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(1)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def main_job_on_one_rank(pools):
    (result,) = pools(1).run(_restoring, _trainer_params, MAIN)
    return result["params"]


# W = 4 (and every W through `ddpkit train`) in benchmarks/exact_resume.py; the user's
# loop below runs at 4 here.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_main_job_ends_with_the_same_bits_at_every_world_size(pools, main_job_on_one_rank,
                                                              world):
    results = pools(world).run(_restoring, _trainer_params, MAIN)
    assert all(r["step"] == 15 for r in results)
    for r in results:
        assert _same(r["params"], main_job_on_one_rank)


def test_the_default_mode_is_not_bit_identical_across_world_sizes(pools, main_job_on_one_rank):
    default = {**MAIN, "train": {**MAIN["train"], "exact": False}}
    (one,) = pools(1).run(_restoring, _trainer_params, default)
    two = pools(2).run(_restoring, _trainer_params, default)
    assert not _same(one["params"], two[0]["params"])
    # ... while it trains the same model: close to exact mode's, not equal to it.
    for a, b in zip(one["params"], main_job_on_one_rank, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


class _DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 48), nn.Linear(48, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _users_loop(world, exact: bool, steps: int = 6, comm: str = "auto",
                precision: str = "fp32"):
    """An ordinary torch loop with AdamW and dropout; exact mode changes two lines.
    ``precision``: "bf16-autocast" (forward under CPU autocast to bfloat16) or
    "bf16-params" (the model's parameters in bfloat16), else float32."""
    import contextlib

    import ddpkit
    from ddpkit.data import ShardSampler

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x_all, y_all = torch.randn(200, 12, generator=g), torch.randint(0, 4, (200,), generator=g)
    options = {"exact": True, "slices": 12, "comm": comm} if exact else {}
    net = _DropoutNet()
    if precision == "bf16-params":
        net, x_all = net.to(torch.bfloat16), x_all.to(torch.bfloat16)
    model = ddpkit.DataParallel(net, **options)

    def autocast():
        if precision == "bf16-autocast":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ShardSampler(x_all, global_batch_size=48, slices=12 if exact else None)
    done = 0
    while done < steps:
        for batch in sampler.batches():
            x, y = x_all[batch.indices], y_all[batch.indices]
            opt.zero_grad()
            if exact:
                for xs, ys in model.slices(x, y):
                    with autocast():
                        out = model(xs)
                    F.cross_entropy(out.float(), ys).backward()
            else:
                F.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_users_loop_with_dropout_ends_with_the_same_bits_at_every_world_size(pools, world):
    (one,) = pools(1).run(_restoring, _users_loop, True)
    results = pools(world).run(_restoring, _users_loop, True)
    for r in results:
        assert _same(r, one)
    if world == 2:  # without exact mode the ranks draw their own masks: other weights
        (plain_one,) = pools(1).run(_restoring, _users_loop, False)
        assert not _same(pools(2).run(_restoring, _users_loop, False)[0], plain_one)


@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16-params"])
def test_bfloat16_ends_with_the_same_bits_at_every_world_size(pools, precision):
    """Autocast to bfloat16 in each slice's forward (what --precision bf16 does), and a
    model whose parameters are bfloat16: W = 2 and 4 end with W = 1's bits, which are
    not float32's."""
    args = (_restoring, _users_loop, True, 6, "auto")
    (one,) = pools(1).run(*args, precision)
    for w in (2, 4):
        for r in pools(w).run(*args, precision):
            assert _same(r, one), w
    (fp32,) = pools(1).run(*args)
    assert not _same([t.float() for t in one], fp32)


@pytest.mark.parametrize("sum_format", ["int32", "float64", "gather", "fold"])
def test_every_transport_sums_to_the_same_bits(pools, sum_format):
    """The exact sum does not depend on how the collectives add or move data, so gloo,
    the ring and shared memory agree (in each format, asked for by name)."""
    auto = pools(2).run(_restoring, _with_sum_format, sum_format, _users_loop, True)[0]
    for comm in ("backend", "ring", "shm"):
        again = pools(2).run(_restoring, _with_sum_format, sum_format, _users_loop, True, 6,
                             comm)[0]
        assert _same(again, auto), comm


def _eager_passes(world, fn, *args):
    """``fn(world, *args)`` with the int32 sum's passes eager (no compile in the worker:
    the same bits, tests/test_exact_compile.py)."""
    import os

    os.environ["DDPKIT_EXACT_COMPILE"] = "0"
    try:
        return fn(world, *args)
    finally:
        os.environ.pop("DDPKIT_EXACT_COMPILE", None)


def test_int32_sum_read_in_place_by_three_ranks_ends_with_one_process_bits(pools):
    """On one host the int32 sum reads every rank's exponents and integers in the shared
    segment and each rank decodes a share into every rank's gradients: W = 3 ends with
    W = 1's bits (W = 2, compiled, against gloo and the ring: the test above)."""
    args = (_restoring, _eager_passes, _with_sum_format, "int32", _users_loop, True, 3)
    (one,) = pools(1).run(*args)
    for r in pools(3).run(*args):
        assert _same(r, one)


def test_stopped_at_two_ranks_and_continued_on_one_ends_with_the_same_bits(pools, tmp_path):
    """(Stopped at 2 and continued at 3 by `ddpkit train`: tests/test_exact_cli.py.)"""
    uninterrupted = pools(2).run(_restoring, _trainer_params, DROPOUT, str(tmp_path / "full"))
    run = str(tmp_path / "run")
    stopped = pools(2).run(_restoring, _trainer_params, DROPOUT, run, 3)
    assert [r["step"] for r in stopped] == [3, 3] and stopped[0]["preempted"]
    resumed = pools(1).run(_restoring, _trainer_params, DROPOUT, run, None, True)
    assert resumed[0]["step"] == 8
    assert any("exact mode draws every random number per slice" in line
               for line in resumed[0]["log"])
    for r in resumed:
        assert _same(r["params"], uninterrupted[0]["params"])


def _run_loop(world, directory, stop_after=None):
    """A user's loop under ddpkit.Run(exact=True) with a DataLoader: 2 epochs, or until
    ``stop_after`` steps (leaving the block checkpoints there)."""
    from torch.utils.data import DataLoader, TensorDataset

    import ddpkit
    from ddpkit.data import ShardSampler

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(100, 12, generator=g),
                         torch.randint(0, 4, (100,), generator=g))
    model = ddpkit.DataParallel(_DropoutNet(), exact=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ShardSampler(data, global_batch_size=24, seed=1)
    loader = DataLoader(data, sampler=sampler, batch_size=sampler.local_batch_size)
    with ddpkit.Run(directory, model=model, optimizer=opt, sampler=sampler, exact=True) as run:
        for _ in run.epochs(2):
            for x, y in run.batches(loader):
                opt.zero_grad()
                for xs, ys in model.slices(x, y):
                    F.cross_entropy(model(xs), ys).backward()
                opt.step()
                run.step_done()
                if run.step == stop_after:
                    break
            if run.step == stop_after:
                break
    return {"params": [p.detach().clone() for p in model.module.parameters()],
            "step": run.step, "slices": model.exact.slice_count}


def test_run_with_a_dataloader_continues_at_another_world_size_with_the_same_bits(pools,
                                                                                  tmp_path):
    full = pools(2).run(_restoring, _run_loop, str(tmp_path / "full"))
    assert full[0]["slices"] == 12 and full[0]["step"] == 10  # 24 -> 12 slices; 5 steps/epoch
    pools(2).run(_restoring, _run_loop, str(tmp_path / "run"), 3)
    (resumed,) = pools(1).run(_restoring, _run_loop, str(tmp_path / "run"))
    assert resumed["step"] == 10
    assert _same(resumed["params"], full[0]["params"])


def _with_sum_format(world, sum_format, fn, *args):
    """``fn(world, *args)`` with ``$DDPKIT_EXACT_SUM`` set to ``sum_format`` (None: unset,
    the default format)."""
    import os

    before = os.environ.pop("DDPKIT_EXACT_SUM", None)
    if sum_format is not None:
        os.environ["DDPKIT_EXACT_SUM"] = sum_format
    try:
        return fn(world, *args)
    finally:
        os.environ.pop("DDPKIT_EXACT_SUM", None)
        if before is not None:
            os.environ["DDPKIT_EXACT_SUM"] = before


def test_a_run_started_with_another_sum_format_continues_with_it_at_another_world_size(
        pools, tmp_path):
    """This small model's default is the fold sum; a run whose checkpoint says int32
    resumes in int32 (the same bits as uninterrupted), not in the default."""
    full = pools(2).run(_restoring, _with_sum_format, "int32", _run_loop,
                        str(tmp_path / "full"))
    pools(2).run(_restoring, _with_sum_format, "int32", _run_loop, str(tmp_path / "run"), 3)
    (resumed,) = pools(1).run(_restoring, _with_sum_format, None, _run_loop,
                              str(tmp_path / "run"))
    assert resumed["step"] == 10
    assert _same(resumed["params"], full[0]["params"])
    # the formats round differently: the check above tells which one the resume used
    (default,) = pools(1).run(_restoring, _with_sum_format, None, _run_loop,
                              str(tmp_path / "default"))
    assert not _same(default["params"], full[0]["params"])


def _unused_parameter(world):
    import ddpkit

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    model = ddpkit.DataParallel(Net(), exact=True, slices=4,
                                find_unused_parameters=True)
    for xs in model.slices(torch.randn(8 // world.world_size, 4)):
        model(xs).square().sum().backward()
    return [p.grad is None for p in model.module.parameters()]


def test_a_parameter_unused_on_every_slice_keeps_no_gradient(pools):
    assert pools(2).run(_restoring, _unused_parameter)[0] == [False, False, True, True]


def _some_slices_skip_a_branch(world):
    """One step's gradients of a model with large parameters (summed where autograd
    left them) and small ones (copied together), one large and one small parameter
    used only by the slices whose first input is positive."""
    import ddpkit

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk, self.side = nn.Linear(256, 160), nn.Linear(256, 160)
            self.head = nn.Linear(160, 3)

        def forward(self, x):
            h = self.trunk(x)
            if x[0, 0] > 0:
                h = h + self.side(x)
            return self.head(torch.tanh(h))

    torch.manual_seed(0)
    model = ddpkit.DataParallel(Net(), exact=True, slices=4,
                                find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    for branch in ([1.0, -1, 1, -1], [-1.0, 1, -1, 1]):  # slices 0, 2; then 1, 3
        x[:, 0] = torch.tensor(branch * 2)
        opt.zero_grad()
        for xs in model.slices(x[world.rank::world.world_size]):
            model(xs).square().mean().backward()
        opt.step()
    return [t.detach().clone() for p in model.module.parameters() for t in (p, p.grad)]


def test_slices_that_skip_a_branch_give_the_same_gradients_at_every_world_size(pools):
    one = pools(1).run(_restoring, _some_slices_skip_a_branch)[0]
    assert one[5].abs().sum() > 0  # the side branch has a gradient
    for w in (2, 4):
        got = pools(w).run(_restoring, _some_slices_skip_a_branch)
        assert all(_same(g, one) for g in got), w


def _verify(world, cfg_dict, per_rank_seed=False):
    import ddpkit
    from ddpkit.train.config import Config
    from ddpkit.train.equivalence import verify

    def wrap(module, engine, device):  # a broken engine: each rank its own streams
        model = ddpkit.DataParallel(module, exact=True, slices=12)
        model.exact.seed += world.rank
        return model

    result = verify(Config.from_dict(cfg_dict), world, steps=6,
                    wrap=wrap if per_rank_seed else None)
    return None if result is None else (result.max_abs_diff, result.passed, result.render())


def test_verify_exact_finds_zero_difference_with_dropout_and_catches_per_rank_streams(pools):
    cfg = {**DROPOUT, "checkpoint": {**DROPOUT["checkpoint"], "every_steps": None}}
    diff, passed, text = pools(2).run(_restoring, _verify, cfg)[0]
    assert diff == 0.0 and passed, text
    assert "max |param(W ranks) - param(1 process)| = 0.000e+00" in text
    diff, passed, _ = pools(2).run(_restoring, _verify, cfg, True)[0]
    assert diff > 0 and not passed


def _refusals(world):
    """Each misuse of exact mode, as one error line."""
    import tempfile

    import ddpkit
    from ddpkit.checkpoint import CheckpointError

    def message(fn):
        try:
            fn()
        except (ddpkit.DdpkitError, CheckpointError) as err:
            return str(err)
        return None

    x, y = torch.randn(12, 12), torch.randint(0, 4, (12,))
    out = {}
    out["running_stats"] = message(lambda: ddpkit.DataParallel(
        nn.Sequential(nn.Linear(12, 8), nn.InstanceNorm1d(8, track_running_stats=True)),
        exact=True, slices=12))
    model = ddpkit.DataParallel(_DropoutNet(), exact=True, slices=12)
    out["outside"] = message(lambda: F.cross_entropy(model(x), y).backward())

    def no_sync_inside():
        for xs, _ys in model.slices(x, y):
            with model.no_sync():
                model(xs)

    out["no_sync"] = message(no_sync_inside)
    out["scalar"] = message(lambda: next(model.slices(torch.tensor(1.0))))

    def one_step():
        for xs, ys in model.slices(x, y):
            F.cross_entropy(model(xs), ys).backward()

    one_step()
    out["zero_grad"] = message(one_step)
    fresh = ddpkit.DataParallel(_DropoutNet(), exact=True, slices=12)
    out["hook"] = message(lambda: fresh.register_comm_hook(None, lambda s, b: None))
    out["shard"] = message(lambda: ddpkit.DataParallel(_DropoutNet(), exact=True,
                                                       slices=12, shard="optimizer"))
    plain = ddpkit.DataParallel(_DropoutNet())
    out["run"] = message(lambda: ddpkit.Run(None, model=plain, exact=True))

    with tempfile.TemporaryDirectory() as tmp:
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ddpkit.Run(tmp, model=model, optimizer=opt, exact=True):
            pass  # writes the final checkpoint of step 0
        other = ddpkit.DataParallel(_DropoutNet(), exact=True, slices=6)
        out["count"] = message(lambda: ddpkit.Run(tmp, model=other, exact=True).__enter__())
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        with ddpkit.Run(tmp + "/default", model=plain, optimizer=plain_opt):
            pass
        out["default"] = message(
            lambda: ddpkit.Run(tmp + "/default", model=model, exact=True).__enter__())
    return out


def test_misuse_of_exact_mode_is_one_line_each(pools):
    out = pools(1).run(_restoring, _refusals)[0]
    expected = {
        "running_stats": "exact mode: InstanceNorm1d '1' updates running statistics",
        "outside": "exact mode: run each training forward/backward inside the slice loop",
        "no_sync": "exact mode has no no_sync()",
        "scalar": "model.slices(...) takes this rank's batch tensors (samples along dim 0)",
        "zero_grad": "still has a gradient when a step's slices begin; call "
                     "optimizer.zero_grad()",
        "hook": "exact mode sums gradients itself; comm hooks do not apply",
        "shard": "exact mode sums whole gradients on every rank; shard='optimizer' does not "
                 "combine with it",
        "run": "Run(exact=True) trains a DataParallel(model, exact=True)",
        "count": "was written with 12 slices, this run has 6; an exact run resumes "
                 "with the same count (--slices 12)",
        "default": "was written without exact mode",
    }
    for key, text in expected.items():
        assert out[key] is not None and text in out[key], (key, out[key])
        assert "\n" not in out[key]
