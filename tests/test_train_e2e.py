"""End to end: `ddpkit train` launches 2 processes through torchrun's agent for one epoch
(the launch is the session's ``default_train_run``, tests/conftest.py)."""

import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ddpkit.loop.metrics_log import read_records
from ddpkit.train.config import resolve


def _one_epoch_in_pool(world, cfg_dict):
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer

    trainer = Trainer(Config.from_dict(cfg_dict), world, write=False)
    return trainer.fit()["final_train_loss"]


@pytest.mark.slow
def test_ddpkit_train_two_processes_one_epoch(default_train_run, pools):
    proc, run_dir = default_train_run  # default engine: ddpkit
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints", "config.json", "curves.png", "metrics.jsonl", "model.pt", "summary.json",
        "train.log"]
    # One checkpoint at the epoch's end, the final one, holding the final model.
    checkpoint = run_dir / "checkpoints" / "step_000000012"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["reason"] == "final" and manifest["world_size"] == 2
    final = torch.load(run_dir / "model.pt", weights_only=True)
    dcp_to_torch_save(checkpoint, run_dir / "one_file.pt")  # torch's own tool reads it
    saved = torch.load(run_dir / "one_file.pt", weights_only=True)
    assert final.keys() == saved["model"].keys()
    assert all(torch.equal(final[k], saved["model"][k]) for k in final)
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (record,) = read_records(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    assert config["train"]["seed"] == 7 and config["world_size"] == 2
    assert record["epoch"] == 1 and record["step"] == 12  # ceil(1438 / 128) steps
    assert record["train_samples"] == 1438 and record["test_samples"] == 359
    assert record["rank_train_samples"] == [719, 719]
    assert 0.5 < record["test_acc"] <= 1 and 0 < record["train_loss"] < 2.31
    assert summary["final_test_acc"] == record["test_acc"] and summary["world_size"] == 2
    assert summary["epochs"] == 1 and summary["steps"] == 12 and summary["engine"] == "ddpkit"
    assert "epoch 1/1: train loss" in proc.stderr and "loss by rank" not in proc.stderr
    (line,) = (run_dir / "train.log").read_text().splitlines()  # the per-rank detail
    ranks = ", ".join(f"{v:.4f}" for v in record["rank_train_loss"])
    assert "epoch 1/1: train loss" in line and f"| loss by rank [{ranks}] |" in line
    # The launched run is the same computation as the same config on 2 pooled ranks.
    cfg = resolve({"epochs": 1, "seed": 7, "threads": 1})
    pooled = pools(2).run(_one_epoch_in_pool, cfg.to_dict())
    assert pooled[0] == pytest.approx(record["train_loss"], rel=1e-9)
