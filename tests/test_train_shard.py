"""`ddpkit train --shard`: the same run as unsharded, with 1/W of the optimizer state per
rank, per-rank memory in the log and summary, and one checkpoint file per rank.

The job is the default one (SGD with momentum: a state tensor per parameter to shard);
the unsharded run is the session's ``default_train_run`` (tests/conftest.py)."""

import json
import subprocess
import sys

import torch

from ddpkit.loop.metrics_log import read_records


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
