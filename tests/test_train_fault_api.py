"""Trainer checkpoints through the API, on pooled ranks: resume at another world size,
fallback from a corrupt checkpoint, a restart before the first checkpoint, and the
sample-id log's replay rule."""

from __future__ import annotations

import collections
import copy
import json
import logging

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ddpkit.loop.sample_ids import SampleLog, read_sample_logs, truncate_sample_logs
from ddpkit.train.config import resolve

SAMPLES = 300
CFG = resolve({"data": "synthetic", "synthetic_size": SAMPLES, "batch_size": 32, "epochs": 2,
               "hidden": [16], "threads": 1, "progress": False, "checkpoint_every_steps": 4,
               "log_sample_ids": True}).to_dict()  # 10 steps per epoch, the last one padded


def _warnings_into(lines: list[str]) -> logging.Handler:
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ddpkit").addHandler(handler)
    return handler


def _train(world, cfg_dict, run_dir, stop_at=None, restore=False):
    """Train (or continue) in ``run_dir``; rank 1 asks for a stop after ``stop_at``."""
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer, unwrap

    lines: list[str] = []
    handler = _warnings_into(lines)
    try:
        trainer = Trainer(Config.from_dict(cfg_dict), world, run_dir=run_dir)
        if stop_at is not None and world.rank == 1:
            trainer.step_callbacks.append(
                lambda t: t.preemption.request() if t.run.step == stop_at else None)
        info = None
        if restore:
            info = trainer.restore()
            info = info and {**info, "step": trainer.run.step,
                             "position": trainer.sampler.position,
                             "optimizer": copy.deepcopy(trainer.optimizer.state_dict())}
        trainer.fit()
    finally:
        logging.getLogger("ddpkit").removeHandler(handler)
    params = [p.detach().clone() for p in unwrap(trainer.model).parameters()]
    return {"params": params, "preempted": trainer.preempted, "step": trainer.run.step,
            "info": info, "log": lines}


def _assert_each_epoch_once(run_dir, epochs=2):
    by_epoch = collections.defaultdict(list)
    for record in read_sample_logs(run_dir):
        by_epoch[record["epoch"]] += record["ids"]
    assert sorted(by_epoch) == list(range(epochs))
    for ids in by_epoch.values():
        assert sorted(ids) == list(range(SAMPLES))


def test_resume_at_another_world_size_keeps_data_position_and_optimizer(pools, tmp_path):
    run = str(tmp_path / "run")
    full = pools(2).run(_train, CFG, str(tmp_path / "uninterrupted"))
    stopped = pools(2).run(_train, CFG, run, 6)
    assert [r["preempted"] for r in stopped] == [True, True]  # rank 1's request stopped both
    assert [r["step"] for r in stopped] == [6, 6]
    one_file = tmp_path / "step_6.pt"
    dcp_to_torch_save(tmp_path / "run" / "checkpoints" / "step_000000006", one_file)
    saved = torch.load(one_file, weights_only=True)

    (resumed,) = pools(1).run(_train, CFG, run, None, True)
    info = resumed["info"]
    assert info["world_size"] == 2 and not info["rng_restored"]
    assert info["step"] == 6 and info["position"] == 6 * 32  # the very next global batch
    restored, written = info["optimizer"]["state"], saved["optimizer"]["state"]
    assert written and len(restored) == len(written)  # momentum was saved and restored
    for mine in restored.values():  # saved by parameter name, restored by position
        assert any(torch.equal(mine["momentum_buffer"], theirs["momentum_buffer"])
                   for theirs in written.values())
    assert any("written by 2 ranks, this run has 1" in line and "differ in the last bits" in line
               for line in resumed["log"]), resumed["log"]
    assert resumed["step"] == 20
    _assert_each_epoch_once(run)
    # Same global batches, same optimizer state: only the order of additions differs.
    for a, b in zip(resumed["params"], full[0]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert metrics[0]["train_samples"] == SAMPLES  # the epoch's sums survived the resume


def test_corrupt_latest_checkpoint_falls_back_and_still_matches(pools, tmp_path):
    run = tmp_path / "run"
    cfg = {**CFG, "train": {**CFG["train"], "epochs": 1}}  # checkpoints at steps 4, 8, 10
    (first, _) = pools(2).run(_train, cfg, str(run))
    payload = run / "checkpoints" / "step_000000010" / "__0_0.distcp"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    again = pools(2).run(_train, cfg, str(run), None, True)
    assert again[0]["info"]["step"] == 8  # fell back past the corrupt step 10
    assert any("sha256 mismatch" in line and "falling back to step_000000008 (" in line
               for line in again[0]["log"]), again[0]["log"]
    for a, b in zip(again[0]["params"], first["params"], strict=True):
        assert torch.equal(a, b)  # same world size: bit for bit
    _assert_each_epoch_once(run, epochs=1)


def test_restart_before_any_checkpoint_starts_over_with_clean_logs(pools, tmp_path):
    run = tmp_path / "run"
    (run / "sample_ids").mkdir(parents=True)
    debris = '{"step": 1, "epoch": 0, "rank": 0, "ids": [1]}\n'  # a failed first attempt's
    (run / "sample_ids" / "rank0.jsonl").write_text(debris)
    (run / "metrics.jsonl").write_text('{"epoch": 1}\n')
    cfg = {**CFG, "train": {**CFG["train"], "epochs": 1}}
    (result,) = pools(1).run(_train, cfg, str(run), None, True)
    assert result["info"] is None and result["step"] == 10
    assert any("no checkpoint" in line and "starting from step 0" in line for line in result["log"])
    _assert_each_epoch_once(run, epochs=1)
    assert [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").open()] == [1]


def test_sample_log_truncation_drops_replayed_steps_and_torn_lines(tmp_path):
    for rank in (0, 1):
        log = SampleLog(tmp_path, rank)
        for step in range(1, 6):
            log.write(step, 0, [10 * step + rank])
        log.close()
    with (tmp_path / "sample_ids" / "rank1.jsonl").open("a") as fh:
        fh.write('{"step": 6, "epo')  # a line cut short by SIGKILL
    truncate_sample_logs(tmp_path, 3)
    records = read_sample_logs(tmp_path)
    assert [(r["step"], r["rank"], r["ids"]) for r in records] == [
        (s, r, [10 * s + r]) for s in (1, 2, 3) for r in (0, 1)]


def run_sample_log_on_a_full_disk(world, full_dir, roomy_dir):
    """Rank 1 logs into ``full_dir`` (a filesystem with no space left), rank 0 into
    ``roomy_dir``: what each rank raises, and what each file holds after."""
    from ddpkit.files.durable import DiskFullError

    log = SampleLog(full_dir if world.rank == 1 else roomy_dir, world.rank)
    try:
        log.write_agreed(1, 0, [world.rank], world.world_size, torch.device("cpu"))
        raised = None
    except DiskFullError as err:
        raised = str(err)
    text = log.path.read_text() if log.path.exists() else None
    return raised, text


def test_a_full_disk_under_one_ranks_sample_log_ends_every_rank_alike(pools, tmp_path):
    from chaos_harness import fill, small_filesystem_or_skip

    with small_filesystem_or_skip(64) as full:
        (full / "sample_ids").mkdir()
        fill(full)
        results = pools(2).run(run_sample_log_on_a_full_disk, str(full), str(tmp_path))
    (raised0, text0), (raised1, text1) = results
    assert raised0 == raised1 and raised0 is not None  # the same line on both ranks
    assert raised0.startswith(f"no space left on device to write {full}/sample_ids/rank1.jsonl: "
                              "it needs ")
    assert text1 is None  # rank 1's log never half-written, not even created empty
    assert text0 == '{"step": 1, "epoch": 0, "rank": 0, "ids": [0]}\n'  # rank 0 wrote its line
