"""The resume seam: Trainer.state_dict() at any step, loaded into a fresh Trainer,
continues to the same final parameters as an uninterrupted run (bit for bit on CPU)."""

import copy

import pytest
import torch

from ddpkit.train.config import resolve

CFG = resolve({"data": "synthetic", "synthetic_size": 299, "batch_size": 32, "epochs": 2,
               "threads": 1}).to_dict()  # 10 steps per epoch, the last one 6 + 5 samples, padded


def _run(world, cfg_dict, save_at, state=None):
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer, unwrap

    trainer = Trainer(Config.from_dict(cfg_dict), world, write=False)
    saved = {}
    executed = []  # the steps this trainer ran itself: a resume must not retrain any

    def capture(t):
        executed.append(t.loop.step)
        if t.loop.step == save_at:
            saved["state"] = copy.deepcopy(t.state_dict())

    trainer.step_callbacks.append(capture)
    if state is not None:
        # The pool hands both ranks tensors in one shared-memory segment, and the
        # optimizer adopts loaded momentum buffers as they are: give each rank its own.
        trainer.load_state_dict(copy.deepcopy(state))
    trainer.fit()
    params = [p.detach().clone() for p in unwrap(trainer.model).parameters()]
    return params, saved.get("state"), executed


@pytest.mark.parametrize("save_at", [4, 10, 13])  # mid-epoch, an epoch's last step, epoch 2
def test_resume_from_any_step_matches_the_uninterrupted_run(pools, save_at):
    full = pools(2).run(_run, CFG, save_at)
    assert full[0][2] == list(range(1, 21))
    states = [r[1] for r in full]
    assert states[0]["loop"]["step"] == save_at
    resumed = pools(2).run(_run, CFG, -1, states[0])
    for (p_full, _, _), (p_res, _, executed) in zip(full, resumed, strict=True):
        # Same seed, same data: a load that did nothing would retrain all 20 steps and
        # still end on the same parameters; only the steps run tell the two apart.
        assert executed == list(range(save_at + 1, 21))
        assert len(p_full) == len(p_res)
        assert all(torch.equal(a, b) for a, b in zip(p_full, p_res, strict=True))


# AdamW, cosine after warm-up, 2 batches per step: 5 steps per epoch, the last of an
# epoch has 2 batches, the last of them padded. Resumed mid-epoch, at an epoch's end
# (the step where the warm-up ends is 3) and in epoch 2.
RECIPE = resolve({"data": "synthetic", "synthetic_size": 299, "batch_size": 32, "epochs": 2,
                  "threads": 1, "optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01,
                  "lr_schedule": "cosine", "warmup_steps": 3, "grad_accum": 2,
                  "clip_grad_norm": 0.5}).to_dict()


@pytest.mark.parametrize("save_at", [2, 5, 7])
def test_resume_with_adamw_cosine_and_grad_accum_matches_the_uninterrupted_run(pools, save_at):
    full = pools(2).run(_run, RECIPE, save_at)
    assert full[0][2] == list(range(1, 11))
    state = full[0][1]
    assert state["loop"]["step"] == save_at
    assert state["optimizer"]["state"] and "exp_avg_sq" in state["optimizer"]["state"][0]
    resumed = pools(2).run(_run, RECIPE, -1, state)
    for (p_full, _, _), (p_res, _, executed) in zip(full, resumed, strict=True):
        assert executed == list(range(save_at + 1, 11))
        assert all(torch.equal(a, b) for a, b in zip(p_full, p_res, strict=True))


def test_workers_refuse_a_checkpoint_written_with_other_settings(tmp_path):
    """Trainer.restore applies the launcher's rule (refuse_changed_config) for itself, so
    a worker started by another launcher cannot continue a run under other settings."""
    from ddpkit.checkpoint import CheckpointError
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer
    from ddpkit.world import World

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
