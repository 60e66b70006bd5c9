"""Rank 0's metric writers (ddpkit.loop.metrics_log): what lands in metrics.jsonl,
metrics.csv and TensorBoard's event files, and what a resumed run does to them."""

from __future__ import annotations

import csv
import json

import pytest

from ddpkit.errors import ConfigError
from ddpkit.loop.metrics_log import (
    CSV_FILE,
    JSONL_FILE,
    TB_DIR,
    MetricLog,
    read_records,
    truncate_records,
)


def records(steps, scale=1.0):
    return [{"step": s, "loss": scale / s, "lr": 0.1 * s, "note": "x"} for s in steps]


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard itself reads back from the event files, per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TB_DIR), purge_orphaned_data=True)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_every_writer_gets_every_numeric_value_of_every_record(tmp_path):
    log = MetricLog(tmp_path, log_with=("jsonl", "csv", "tensorboard"))
    for r in records([1, 2, 3]):
        log.write(r)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / JSONL_FILE).read_text().splitlines()]
    assert lines == records([1, 2, 3])
    with (tmp_path / CSV_FILE).open() as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["loss"]) for r in rows] == [1.0, 0.5, 1 / 3]
    scalars = tensorboard_scalars(tmp_path)
    assert sorted(scalars) == ["loss", "lr"]  # the string "note" is not a scalar
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3]
    assert [v for _, v in scalars["lr"]] == pytest.approx([0.1, 0.2, 0.3])


def test_a_resumed_run_replaces_the_steps_it_replays_in_tensorboard(tmp_path):
    """Stopped after step 5, resumed from the checkpoint of step 3: TensorBoard shows
    steps 1-3 of the first attempt and 4-6 of the second, each step once."""
    first = MetricLog(tmp_path, log_with=("tensorboard",))
    for r in records(range(1, 6)):
        first.write(r)
    first.close()
    second = MetricLog(tmp_path, log_with=("tensorboard",), start_step=3)
    for r in records(range(4, 7), scale=2.0):
        second.write(r)
    second.close()
    loss = tensorboard_scalars(tmp_path)["loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in loss] == pytest.approx([1, 1 / 2, 1 / 3, 2 / 4, 2 / 5, 2 / 6])


def test_a_resume_keeps_the_records_up_to_its_step_in_every_file(tmp_path):
    """Resumed from the checkpoint of step 3 after a crash mid-line at step 5: the
    records of steps 1-3 stay in metrics.jsonl and metrics.csv, nothing else does, and
    the rewrite leaves no temporary file behind."""
    log = MetricLog(tmp_path, log_with=("jsonl", "csv"))
    for r in records(range(1, 6)):
        log.write(r)
    log.close()
    with (tmp_path / JSONL_FILE).open("a") as fh:
        fh.write('{"step": 6, "lo')  # the crash
    truncate_records(tmp_path, 3)
    assert read_records(tmp_path / JSONL_FILE) == records([1, 2, 3])
    with (tmp_path / CSV_FILE).open() as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh)] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [CSV_FILE, JSONL_FILE]


def test_unknown_writer_is_one_line():
    with pytest.raises(ConfigError, match="tensorboard"):
        MetricLog("unused", log_with=("wandb",))
