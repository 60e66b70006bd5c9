"""End to end: `ddpkit train` launches 2 processes through torchrun's agent for one epoch;
and `ddpkit train --shard`: the same run as unsharded, with 1/W of the optimizer state per
rank, per-rank memory in the log and summary, and one checkpoint file per rank.

Both compare with one launch, ``default_train_run`` below: the default job (SGD with
momentum: a state tensor per parameter to shard) at 2 processes, one epoch. The two were
separate files, so pytest-xdist (whole files per worker) could launch it on each worker.
"""

import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ddpkit.loop.metrics_log import read_records
from ddpkit.train.config import resolve


@pytest.fixture(scope="module")
def default_train_run(tmp_path_factory):
    """One `ddpkit train --nproc-per-node 2 --epochs 1 --seed 7` launch with every other
    option at its default: (the completed process, its run directory), shared by the
    tests that check that run and those that compare other runs with it."""
    out = tmp_path_factory.mktemp("default-train") / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit.cli", "train", "--nproc-per-node", "2", "--epochs", "1",
         "--seed", "7", "--out-dir", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()  # one new run directory
    return proc, run_dir


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


def test_sharded_run_equals_unsharded_with_half_the_optimizer_state(default_train_run,
                                                                   tmp_path):
    # The unsharded run is the session's default run: these options, --shard none.
    _, plain_dir = default_train_run
    out = tmp_path / "sharded"
    proc = subprocess.run([sys.executable, "-m", "ddpkit.cli", "train", "--nproc-per-node", "2",
                           "--epochs", "1", "--seed", "7", "--out-dir", str(out),
                           "--shard", "parameters", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    stderr = proc.stderr
    plain = torch.load(plain_dir / "model.pt", weights_only=True)
    sharded = torch.load(run_dir / "model.pt", weights_only=True)
    assert plain.keys() == sharded.keys()
    assert all(torch.equal(plain[k], sharded[k]) for k in plain)  # W = 2: the same bits

    summary = json.loads((run_dir / "summary.json").read_text())
    plain_summary = json.loads((plain_dir / "summary.json").read_text())
    assert summary["shard"] == "parameters" and plain_summary["shard"] == "none"
    assert summary["optimizer_state_mib"] < 0.55 * plain_summary["optimizer_state_mib"]
    assert len(summary["rank_peak_rss_mib"]) == 2 and min(summary["rank_peak_rss_mib"]) > 50
    (record,) = read_records(run_dir / "metrics.jsonl")
    assert len(record["rank_peak_rss_mib"]) == 2
    assert "peak RSS by rank [" not in stderr  # in the run's log instead
    (line,) = (run_dir / "train.log").read_text().splitlines()
    memory = ", ".join(f"{v:.0f}" for v in record["rank_peak_rss_mib"])
    assert line.endswith(f"| peak RSS by rank [{memory}] MiB"), line
    config = json.loads((run_dir / "config.json").read_text())
    assert config["train"]["shard"] == "parameters"
    checkpoint = run_dir / "checkpoints" / "step_000000012"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    # Each rank wrote its part (DCP), every file listed with its hash.
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "run.pt"]
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted([*manifest["files"],
                                                                  "manifest.json"])


def test_shard_with_the_torch_engine_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddpkit.cli", "train", "--engine", "torch",
                           "--shard", "optimizer", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddpkit train: error: --shard 'optimizer' needs --engine ddpkit (torch's DDP does not "
        "shard; torch's ZeroRedundancyOptimizer is the nearest)"]
