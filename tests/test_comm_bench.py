"""`ddpkit bench collectives` and `ddpkit bench shm`: size parsing, bandwidth arithmetic, the
shm columns and verdicts, and the CLI end to end."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from ddpkit.bench import collective_timing as bench
from ddpkit.cli import main as cli_main
from ddpkit.errors import ConfigError


def test_parse_sizes_ranges_and_lists():
    assert bench.parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert bench.parse_sizes("1K:256M")[-1] == 256 << 20
    assert len(bench.parse_sizes("1K:256M")) == 19
    assert bench.parse_sizes("1K:64K:4") == [1024, 4096, 16384, 65536]
    assert bench.parse_sizes("100,2MB,1g") == [100, 2 << 20, 1 << 30]
    for bad in ("1X", "8K:1K", "1K:2K:1", "1K:2K:x", "", "1:2:3:4"):
        with pytest.raises(ConfigError):
            bench.parse_sizes(bad)


def test_bus_factors_follow_nccl_tests():
    assert bench.bus_factor("all_reduce", 2) == 1.0
    assert bench.bus_factor("all_reduce", 4) == 1.5
    assert bench.bus_factor("all_gather", 4) == 0.75
    assert bench.bus_factor("reduce_scatter", 2) == 0.5
    assert bench.bus_factor("broadcast", 8) == 1.0


def _read_csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_cli_sweep_prints_table_and_writes_files(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit.cli", "bench", "collectives", "--nproc-per-node", "2",
         "--algo", "ring,backend", "--sizes", "4K,256K", "--warmup", "1", "--repeats", "2",
         "--out-dir", str(out)],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[2/2]" in proc.stderr  # progress went to stderr
    table = [ln for ln in proc.stdout.splitlines() if ln and not ln.startswith("#")]
    assert [int(ln.split()[0]) for ln in table] == [4096, 262144]
    assert "ring/backend" in proc.stdout
    rows = _read_csv(out / "collectives-all_reduce.csv")
    assert {(r["algo"], int(r["bytes"])) for r in rows} == {
        (a, s) for a in ("ring", "backend") for s in (4096, 262144)
    }
    for r in rows:
        t = float(r["time_us"]) * 1e-6
        assert t > 0
        algbw = int(r["bytes"]) / t / 1e9
        assert float(r["algbw_gbps"]) == pytest.approx(algbw, rel=1e-3)
        assert float(r["busbw_gbps"]) == pytest.approx(algbw * 1.0, rel=1e-3)  # 2(n-1)/n, n=2
        assert int(r["elements"]) * 4 == int(r["bytes"])
    with open(out / "collectives-all_reduce.json") as f:
        doc = json.load(f)
    assert doc["config"]["algos"] == ["ring", "backend"] and len(doc["rows"]) == 4
    with open(out / "collectives-all_reduce.png", "rb") as f:
        assert f.read(8).startswith(b"\x89PNG")


def test_cli_refuses_to_overwrite_results(tmp_path, capsys):
    (tmp_path / "collectives-all_reduce.csv").write_text("keep me\n")
    code = cli_main(["bench", "collectives", "--sizes", "4K", "--out-dir", str(tmp_path)])
    assert code == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "collectives-all_reduce.csv").read_text() == "keep me\n"


def test_sweep_on_three_ranks_other_collective(pools):
    cfg = bench.BenchConfig(op="all_gather", algos=("ring", "backend"), sizes=(3000, 70_000),
                            nproc=3, warmup=0, repeats=1, threads=1)
    rows, *others = pools(3).run(bench.run_rank, cfg)
    assert others == [None, None]  # only rank 0 reports
    assert len(rows) == 4
    for row in rows:
        assert row["nranks"] == 3 and row["elements"] % 3 == 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 / 3)
    table = bench.collectives_table(bench.BenchResult(cfg, [bench.Row(**r) for r in rows]))
    assert "ring/backend" in table and "busbw factor 0.667" in table


@pytest.mark.parametrize(
    "args, message",
    [
        (("--algo", "ring,nope"), "--algo 'nope' is not registered"),
        (("--algo", "ring,ring"), "lists a name twice"),
        (("--op", "alltoall"), "--op 'alltoall'"),
        (("--nproc-per-node", "1"), "--nproc-per-node must be >= 2"),
        (("--sizes", "1Q"), "cannot read size"),
        (("--dtype", "float8"), "--dtype 'float8'"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["bench", "collectives", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert err[0].startswith("ddpkit bench collectives: error: "), err
    assert not os.path.exists(tmp_path / "runs")  # nothing written on a refusal


# ---------------------------------------------------------------- ddpkit bench shm


def signatures_each_shm_column_passes(world) -> dict:
    """The ``signature=`` every column hands ShmCommunicator.all_reduce, per column."""
    from ddpkit.bench import shm as shm_bench
    from ddpkit.comm.shm import ShmCommunicator
    from ddpkit.comm.shm.direct import DirectAllReduce

    seen: list = []
    original, direct = ShmCommunicator.all_reduce, DirectAllReduce.__call__

    def spy(self, tensor, op="sum", **kwargs):
        seen.append(kwargs.get("signature"))
        return original(self, tensor, op, **kwargs)

    def direct_spy(self, tensor):  # a repeated public call: the word it was bound to
        seen.append(self.word)
        calls = len(seen)
        result = direct(self, tensor)
        del seen[calls:]  # its own fallback to the generic path is the same call
        return result

    ShmCommunicator.all_reduce = spy
    DirectAllReduce.__call__ = direct_spy
    try:
        with ShmCommunicator(timeout=60) as comm:
            private = torch.ones(256)
            calls = shm_bench._calls(comm, private, comm.allocate(256))
            out = {}
            for name in ("comm", "comm-nocheck", "shm-copy", "shm-signed"):
                seen.clear()
                calls[name]()
                out[name] = list(seen)
    finally:
        ShmCommunicator.all_reduce = original
        DirectAllReduce.__call__ = direct
    return out


def test_shm_signed_column_passes_the_public_doors_signature(pools):
    for out in pools(2).run(signatures_each_shm_column_passes):
        assert out["shm-copy"] == [None]  # the private engine: no signature
        assert len(out["comm"]) == 1 and isinstance(out["comm"][0], int)
        assert out["shm-signed"] == out["comm"] == out["comm-nocheck"]


def test_shm_bench_rows_and_verdicts(pools):
    from ddpkit.bench import shm as shm_bench

    cfg = shm_bench.Config(nprocs=2, sizes=(1024, 100_000), budget_s=0.005, rounds=1)
    rows, other = pools(2).run(shm_bench.run_rank, cfg)
    assert {(r["algo"], r["bytes"]) for r in rows} == {
        (a, s) for a in shm_bench.ALGOS for s in (1024, 100_000)}
    assert all(r["time_us"] > 0 for r in rows)
    table = shm_bench.shm_table(rows, 2)
    assert "in-band check cost (shm-signed vs shm-copy): worst" in table
    assert "spread between identical runs" in table
    assert "default check cost" not in table


def _rows(times: dict) -> list[dict]:
    return [{"algo": a, "bytes": b, "time_us": t, "speedup_vs_gloo": 100.0}
            for (a, b), t in times.items()]


def test_shm_check_cost_verdict_is_the_worst_size():
    from ddpkit.bench import shm as shm_bench

    times = {("shm-copy", 1024): 5.0, ("shm-signed", 1024): 5.4,
             ("shm-copy", 4 << 20): 300.0, ("shm-signed", 4 << 20): 290.0,
             ("comm", 1024): 12.0, ("comm-nocheck", 1024): 10.0}
    lines = shm_bench.verdicts(_rows(times))
    assert ("in-band check cost (shm-signed vs shm-copy): worst +8.0% (met: <= +10%)"
            in lines), lines
    assert any(ln.startswith("spread between identical runs") and "+20.0%" in ln
               for ln in lines)
    assert not any("met" in ln for ln in lines if ln.startswith("spread"))
    times[("shm-signed", 1024)] = 5.6
    assert ("in-band check cost (shm-signed vs shm-copy): worst +12.0% (not met: <= +10%)"
            in shm_bench.verdicts(_rows(times)))
