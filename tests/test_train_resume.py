"""Resume as production does it: a run stopped at any step (a stop request, which
writes a checkpoint there), continued by a fresh Trainer in the same run directory
(Trainer.restore, then fit), ends on the same parameters as an uninterrupted run (bit
for bit on CPU) without retraining a step."""

import pytest
import torch

from ddpkit.train.config import resolve

CFG = resolve({"data": "synthetic", "synthetic_size": 299, "batch_size": 32, "epochs": 2,
               "threads": 1, "progress": False}).to_dict()
# 10 steps per epoch, the last one 6 + 5 samples, padded


def _run(world, cfg_dict, run_dir=None, stop_at=None, restore=False):
    """Train (``run_dir`` None: in memory); ask for a stop after step ``stop_at``, or
    continue the run of ``run_dir`` from its newest checkpoint."""
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer, unwrap

    trainer = Trainer(Config.from_dict(cfg_dict), world, run_dir=run_dir,
                      write=run_dir is not None)
    executed = []  # the steps this trainer ran itself: a resume must not retrain any

    def capture(t):
        executed.append(t.run.step)
        if t.run.step == stop_at:
            t.preemption.request()

    trainer.step_callbacks.append(capture)
    restored_at = None
    if restore:
        trainer.restore(required=True)
        restored_at = trainer.run.step
    trainer.fit()
    params = [p.detach().clone() for p in unwrap(trainer.model).parameters()]
    return {"params": params, "executed": executed, "preempted": trainer.preempted,
            "restored_at": restored_at}


def _stop_and_resume(pools, cfg, save_at, steps, tmp_path):
    full = pools(2).run(_run, cfg)
    assert full[0]["executed"] == list(range(1, steps + 1))
    run_dir = str(tmp_path / "run")
    stopped = pools(2).run(_run, cfg, run_dir, save_at)
    assert [r["preempted"] for r in stopped] == [True, True]
    assert stopped[0]["executed"] == list(range(1, save_at + 1))
    resumed = pools(2).run(_run, cfg, run_dir, None, True)
    for f, r in zip(full, resumed, strict=True):
        assert r["restored_at"] == save_at
        # Same seed, same data: a load that did nothing would retrain all the steps and
        # still end on the same parameters; only the steps run tell the two apart.
        assert r["executed"] == list(range(save_at + 1, steps + 1))
        assert len(f["params"]) == len(r["params"])
        assert all(torch.equal(a, b) for a, b in zip(f["params"], r["params"], strict=True))


@pytest.mark.parametrize("save_at", [4, 10, 13])  # mid-epoch, an epoch's last step, epoch 2
def test_resume_from_any_step_matches_the_uninterrupted_run(pools, save_at, tmp_path):
    _stop_and_resume(pools, CFG, save_at, 20, tmp_path)


# AdamW, cosine after warm-up, 2 batches per step: 5 steps per epoch, the last of an
# epoch has 2 batches, the last of them padded. Resumed mid-epoch, at an epoch's end
# (the step where the warm-up ends is 3) and in epoch 2.
RECIPE = resolve({"data": "synthetic", "synthetic_size": 299, "batch_size": 32, "epochs": 2,
                  "threads": 1, "optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01,
                  "lr_schedule": "cosine", "warmup_steps": 3, "grad_accum": 2,
                  "clip_grad_norm": 0.5, "progress": False}).to_dict()


@pytest.mark.parametrize("save_at", [2, 5, 7])
def test_resume_with_adamw_cosine_and_grad_accum_matches_the_uninterrupted_run(
        pools, save_at, tmp_path):
    _stop_and_resume(pools, RECIPE, save_at, 10, tmp_path)


def test_workers_refuse_a_checkpoint_written_with_other_settings(tmp_path):
    """Trainer.restore applies the launcher's rule (refuse_changed_config) for itself, so
    a worker started by another launcher cannot continue a run under other settings."""
    from ddpkit.checkpoint import CheckpointError
    from ddpkit.runtime.world import World
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer

    def plain(module, engine, device):
        return module  # one process, no process group: no engine needed

    small = {**CFG, "data": {**CFG["data"], "synthetic_size": 64},
             "train": {**CFG["train"], "epochs": 1, "progress": False}}
    Trainer(Config.from_dict(small), World(), run_dir=tmp_path, wrap=plain).fit()
    wider = {**small, "model": {**small["model"], "hidden": [16]}}
    trainer = Trainer(Config.from_dict(wider), World(), run_dir=tmp_path, wrap=plain)
    with pytest.raises(CheckpointError) as err:
        trainer.restore()
    assert str(err.value) == (
        f"checkpoint of step 2 in {tmp_path / 'checkpoints'} was written with other settings "
        "(model.hidden: [128] -> [16]); leave those options out to resume, or start a new run")
