"""The data audit shared by the kill/preempt-and-resume tests: a resumed run's sample-id
logs are the uninterrupted run's, every step once per rank and every sample once per
epoch."""

from __future__ import annotations

import collections
from pathlib import Path

from ddpkit.loop.sample_ids import read_sample_logs


def assert_every_sample_once(run: Path, reference: Path, *, epochs: int, steps_per_epoch: int,
                             world: int, samples: int) -> None:
    records = read_sample_logs(run)
    steps = collections.Counter((r["step"], r["rank"]) for r in records)
    assert sorted(steps) == [(s, r) for s in range(1, epochs * steps_per_epoch + 1)
                             for r in range(world)]
    assert set(steps.values()) == {1}, "a replayed step was logged twice"
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for r in records:
        by_epoch[r["epoch"]] += r["ids"]
    assert sorted(by_epoch) == list(range(epochs))
    for epoch, ids in by_epoch.items():
        assert sorted(ids) == list(range(samples)), f"epoch {epoch}: lost or repeated samples"
    assert records == read_sample_logs(reference)
