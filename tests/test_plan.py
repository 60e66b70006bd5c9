"""`ddpkit plan`: the alpha-beta formulas, the fit, DDP's bucket layout, the CLI.

Timings are never asserted (other work shares these cores): the model's accuracy on this
machine is measured by `ddpkit plan validate` and recorded in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import csv
import json
import math

import pytest

from conftest import ROOT
from ddpkit import ConfigError, cli
from ddpkit.plan import published, validate
from ddpkit.plan.calibrate import Calibration, fit
from ddpkit.plan.model import (
    DDP_MEMORY_PASSES,
    DDP_PER_TENSOR_S,
    DEVICES,
    DGX1_NVLINKS,
    PRESETS,
    Cluster,
    Link,
    StepModel,
    allreduce_time,
    bucket_sizes,
    ddp_overhead_s,
    equal_param_bytes,
    expected_max_normal,
    predict_step,
    ring_time,
    slowest_of,
    transformer_param_bytes,
    tree_time,
)

PUBLISHED_CSV = f"{ROOT}/benchmarks/data/torch_ddp_v100_published.csv"

FAST = Link("fast", 2e-6, 400e9)
SLOW = Link("slow", 10e-6, 25e9)


# ------------------------------------------------------------------------ formulas
def test_ring_and_tree_by_hand():
    n = 1e9
    assert ring_time(n, 8, FAST) == pytest.approx(14 * 2e-6 + 14 / 8 * n / 400e9)
    assert tree_time(n, 8, FAST) == pytest.approx(6 * 2e-6 + 2 * n / 400e9)
    assert tree_time(n, 5, FAST) == pytest.approx(6 * 2e-6 + 2 * n / 400e9)  # ceil(log2 5)=3
    assert ring_time(n, 1, FAST) == tree_time(n, 1, FAST) == 0.0


def test_cluster_links():
    one_node = Cluster(1, 8, FAST, SLOW)
    for algo in ("ring", "hierarchical"):
        assert allreduce_time(1e8, one_node, algo) == pytest.approx(ring_time(1e8, 8, FAST))
    two = Cluster(2, 8, FAST, SLOW)
    # a flat ring crosses nodes on 8 NICs at once: 8 x 25 GB/s < 400 GB/s bounds it
    assert two.flat_link().bandwidth_Bps == 200e9 and two.flat_link().alpha_s == 10e-6
    assert allreduce_time(1e8, two, "ring") == pytest.approx(
        30 * 10e-6 + 30 / 16 * 1e8 / 200e9)
    # hierarchical: an intra-node ring all-reduce, plus 1/8 of the data between 2 nodes
    assert allreduce_time(1e8, two, "hierarchical") == pytest.approx(
        ring_time(1e8, 8, FAST) + 2 * 10e-6 + 1e8 / 8 / 25e9)
    assert allreduce_time(1e8, two, "best") == min(
        allreduce_time(1e8, two, a) for a in ("ring", "tree", "hierarchical"))
    with pytest.raises(ConfigError, match="unknown all-reduce algorithm"):
        allreduce_time(1.0, two, "butterfly")


def test_a_mesh_gives_a_few_gpus_only_the_links_among_them():
    nvlink2 = PRESETS["nvlink2"]
    assert all(sum(row) == 6 for row in DGX1_NVLINKS)  # six NVLinks per V100
    assert all(DGX1_NVLINKS[i][j] == DGX1_NVLINKS[j][i] for i in range(8) for j in range(8))
    # GPUs 0-1: one link; 0-2: GPU 0 has two links to the others; 0-3: four; all: six
    assert [nvlink2.among(g).bandwidth_Bps for g in (2, 3, 4, 8)] == [25e9, 50e9, 100e9, 150e9]
    assert nvlink2.among(1) is nvlink2 and FAST.among(2) is FAST  # a switch: no mesh
    two_gpus = Cluster(1, 2, nvlink2, SLOW)
    assert two_gpus.flat_link().bandwidth_Bps == 25e9
    assert allreduce_time(1e8, two_gpus, "ring") == pytest.approx(ring_time(1e8, 2, Link(
        "one NVLink", 2e-6, 25e9)))
    # across nodes every GPU of a node takes part: the whole mesh
    two_nodes = Cluster(2, 8, nvlink2, SLOW, nics_per_node=4)
    assert two_nodes.intra_link().bandwidth_Bps == 150e9


def test_latency_dominates_ring_at_scale_tree_does_not():
    big = Cluster(128, 8, FAST, SLOW)
    small_msg = 64 * 1024
    assert allreduce_time(small_msg, big, "ring") > 50 * allreduce_time(small_msg, big, "tree")


# ------------------------------------------------------------------------ buckets
def test_bucket_sizes_reverse_order_and_small_first_bucket():
    mib = 1 << 20
    sizes = [4 * mib, 4 * mib, 30 * mib, 2 * mib, 512 * 1024]
    # reversed: 0.5, 2 (first bucket closes past 1 MiB), 30 (closes), 4 + 4 (left over)
    assert bucket_sizes(sizes, 25 * mib, mib) == [int(2.5 * mib), 30 * mib, 8 * mib]
    assert sum(bucket_sizes(sizes, 25 * mib)) == sum(sizes)
    with pytest.raises(ConfigError):
        bucket_sizes(sizes, 0)


def ddp_bucket_sizes(world, widths, cap_mb):
    """Bucket sizes (bytes) torch's own DDP uses after its first-iteration rebuild."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = validate._mlp(tuple(widths))
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    x = torch.randn(2, widths[0])
    for _ in range(2):
        ddp(x).sum().backward()
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    params = [p.numel() * p.element_size() for p in model.parameters()]
    return [b.buffer().numel() * b.buffer().element_size() for b in buckets], params


@pytest.mark.parametrize("cap_mb", [None, 2.0])
def test_bucket_model_matches_torch_ddp(pools, cap_mb):
    got, params = pools(2).run(ddp_bucket_sizes, (256, 1024, 1024, 512, 10), cap_mb)[0]
    assert len(got) > 1
    assert sorted(got) == sorted(bucket_sizes(params, *validate.bucket_caps(cap_mb)))


def test_transformer_layout_sums_to_total():
    sizes = transformer_param_bytes(4e9, 24)
    assert len(sizes) == 96 and sum(sizes) == 4_000_000_000


# ------------------------------------------------------------------------ step model
def test_step_without_overlap_is_a_plain_sum():
    step = StepModel(0.1, 0.2, 0.05)
    pred = predict_step(step, [10, 20, 30], lambda n: n * 1e-3, overlap=0.0)
    assert pred.step_s == pytest.approx(0.35 + 0.06)
    assert pred.exposed_comm_s == pytest.approx(0.06)


def test_step_with_overlap_hides_all_but_the_tail():
    step = StepModel(0.1, 0.2, 0.0)
    # three equal buckets ready at 1/3, 2/3 and all of backward; each takes 10 ms
    pred = predict_step(step, [1, 1, 1], lambda n: 0.01, overlap=1.0)
    assert pred.step_s == pytest.approx(0.3 + 0.01)
    # communication slower than backward: the stream is busy from the first bucket on
    slow = predict_step(step, [1, 1, 1], lambda n: 0.2, overlap=1.0)
    assert slow.step_s == pytest.approx(0.1 + 0.2 / 3 + 3 * 0.2)
    for overlap in (0.0, 0.5, 1.0):
        partial = predict_step(step, [1, 1, 1], lambda n: 0.05, overlap=overlap)
        assert 0.3 + 0.05 - 1e-12 <= partial.step_s <= 0.3 + 0.15 + 1e-12
    with pytest.raises(ConfigError):
        predict_step(step, [1], lambda n: 0.0, overlap=1.5)


# ---------------------------------------------------------------------- calibration
def test_fit_recovers_the_generating_link():
    truth = Calibration(2, 150e-6, 1.2e9, ())
    points = [(n, truth.predict(n)) for n in (4096, 65536, 1 << 20, 16 << 20, 64 << 20)]
    cal = fit(points, 2)
    assert cal.alpha_s == pytest.approx(150e-6, rel=1e-6)
    assert cal.bandwidth_Bps == pytest.approx(1.2e9, rel=1e-6)
    assert max(abs(e[3]) for e in cal.errors()) < 1e-9
    noisy = fit([(n, t * (1.1 if i % 2 else 0.9)) for i, (n, t) in enumerate(points)], 2)
    assert 0.5 < noisy.bandwidth_Bps / 1.2e9 < 2
    with pytest.raises(ConfigError, match="two different sizes"):
        fit([(4096, 1e-3)], 2)
    with pytest.raises(ConfigError, match="does not grow"):
        fit([(4096, 2e-3), (1 << 20, 1e-3)], 2)


def bench_json(path, rows_us, nranks=2):
    rows = [dict(op="all_reduce", algo="backend", nranks=nranks, bytes=b, time_us=t)
            for b, t in rows_us]
    rows.append(dict(op="all_reduce", algo="ring", nranks=nranks, bytes=4096, time_us=1e6))
    path.write_text(json.dumps({"config": {}, "meta": {}, "rows": rows}))
    return path


def test_calibrate_from_bench_json(tmp_path, capsys):
    truth = Calibration(2, 100e-6, 1e9, ())
    src = bench_json(tmp_path / "collectives-all_reduce.json",
                     [(n, 1e6 * truth.predict(n)) for n in (4096, 1 << 20, 64 << 20)])
    out = tmp_path / "cal.json"
    assert cli.main(["plan", "calibrate", "--from", str(src), "--out", str(out)]) == 0
    cal = Calibration.from_json(json.loads(out.read_text()))
    assert cal.bandwidth_Bps == pytest.approx(1e9, rel=1e-6)  # the "ring" row was ignored
    assert "fitted link alpha 100.0 us" in capsys.readouterr().out
    assert cli.main(["plan", "calibrate", "--from", str(src), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_calibrate_rejects_foreign_json(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    assert cli.main(["plan", "calibrate", "--from", str(bad), "--out",
                     str(tmp_path / "c.json")]) == 2
    assert "no all_reduce rows" in capsys.readouterr().err


# ------------------------------------------------------------------------ projection
def test_project_writes_table_csv_png(tmp_path, capsys):
    out = tmp_path / "plan"
    assert cli.main(["plan", "project", "--gpus", "1:64", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 B parameters" in text and "nvlink4" in text and "ib-ndr" in text
    with (out / "plan.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {int(r["gpus"]) for r in rows} == {1, 2, 4, 8, 16, 32, 64}
    ring = sorted((r for r in rows if r["algo"] == "ring"), key=lambda r: int(r["gpus"]))
    # one GPU: nothing to reduce, but DDP's own per-step work is paid already
    assert float(ring[0]["allreduce_s"]) == 0.0
    one = float(ring[0]["compute_s"])
    overhead = ddp_overhead_s(96, 4e9, DEVICES["h100"].memory_Bps)  # 24 blocks x 4 tensors
    assert float(ring[0]["step_s"]) == pytest.approx(one + overhead, rel=1e-5)
    comm = [float(r["allreduce_s"]) for r in ring]
    assert comm == sorted(comm)  # more ranks never make the ring cheaper
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["plan", "project", "--gpus", "1:64", "--out-dir", str(out)]) == 2


@pytest.mark.parametrize(("args", "message"), [
    (["--intra", "warp-drive"], "--intra 'warp-drive' is not one of nvlink2, nvlink4"),
    (["--gpus", "12", "--gpus-per-node", "8"], "not a whole number"),
    (["--algo", "butterfly"], "--algo 'butterfly'"),
    (["--overlap", "2"], "--overlap must be in [0, 1], got 2"),
    (["--mfu", "0"], "--mfu must be in (0, 1] (a fraction of peak), got 0"),
    (["--params", "-5"], "--params must be a positive number, got -5"),
    (["--params", "nan"], "--params must be a positive number, got nan"),
    (["--step-ms", "0"], "--step-ms must be a positive number, got 0"),
    (["--param-tensors", "-1"], "--param-tensors must be a positive number, got -1"),
    (["--nics-per-node", "0"], "--nics-per-node must be a positive number, got 0"),
    (["--device", "tpu"], "--device 'tpu' is not one of v100, a100, h100"),
    (["--spread", "1.5"], "--spread must be in [0, 1)"),
])
def test_project_bad_input(tmp_path, capsys, args, message):
    assert cli.main(["plan", "project", "--out-dir", str(tmp_path / "p"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddpkit plan project: error: ") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "p").exists()  # checked before anything is written


# ------------------------------------------------------------- DDP overhead, stragglers
def test_ddp_overhead_is_per_tensor_plus_memory_passes():
    assert ddp_overhead_s(0, 0, 1e12) == 0.0
    assert ddp_overhead_s(100, 1e9, 1e12) == pytest.approx(
        100 * DDP_PER_TENSOR_S + DDP_MEMORY_PASSES * 1e-3)
    with pytest.raises(ConfigError):
        ddp_overhead_s(-1, 0, 1e12)


def test_expected_slowest_of_p_devices():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-6)
    grows = [expected_max_normal(p) for p in (2, 4, 8, 16, 1024)]
    assert grows == sorted(grows) and 3.0 < grows[-1] < 3.5
    assert slowest_of(1, 0.05) == 1.0 and slowest_of(2, 0.0) == 1.0
    assert slowest_of(2, 0.1) == pytest.approx(1 + 0.1 / math.sqrt(math.pi), abs=1e-6)


def test_overhead_follows_the_last_bucket_and_slowdown_stretches_compute():
    step = StepModel(0.1, 0.2, 0.05)
    pred = predict_step(step, [1, 1], lambda n: 0.0, 1.0, overhead_s=0.01, slowdown=1.1)
    assert pred.step_s == pytest.approx(0.3 * 1.1 + 0.01 + 0.05)
    assert pred.compute_s == pytest.approx(0.35)  # efficiency is against one plain device
    # the last bucket is ready only when the (stretched) backward ends: never hidden
    tail = predict_step(step, [1, 1], lambda n: 0.02, 1.0, overhead_s=0.01, slowdown=1.0)
    assert tail.step_s == pytest.approx(0.3 + 0.02 + 0.01 + 0.05)
    with pytest.raises(ConfigError):
        predict_step(step, [1], lambda n: 0.0, slowdown=0.9)


def test_project_from_a_measured_step_with_tensor_count_and_nics(tmp_path, capsys):
    out = tmp_path / "plan"
    assert cli.main(["plan", "project", "--step-ms", "100", "--params", "25e6",
                     "--param-tensors", "160", "--gpus", "1,16", "--device", "v100",
                     "--intra", "nvlink2", "--inter", "ib-edr", "--nics-per-node", "4",
                     "--spread", "0", "--out-dir", str(out), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "160 tensors" in text and "4 NICs per node" in text and "nvlink2" in text
    with (out / "plan.csv").open() as f:
        rows = {(int(r["gpus"]), r["algo"]): r for r in csv.DictReader(f)}
    overhead = ddp_overhead_s(160, 1e8, 900e9)
    assert float(rows[1, "ring"]["step_s"]) == pytest.approx(0.1 + overhead, rel=1e-5)
    # 16 GPUs = 2 nodes: a flat ring crosses them on 4 NICs x 12.5 GB/s = 50 GB/s
    buckets = bucket_sizes(equal_param_bytes(1e8, 160), 25 << 20, 1 << 20)
    ring16 = sum(ring_time(b, 16, Link("x", 5e-6, 50e9)) for b in buckets)
    assert float(rows[16, "ring"]["allreduce_s"]) == pytest.approx(ring16, rel=1e-5)


def test_published_torch_ddp_rows_within_three_percent():
    """Every row of torch DDP's published V100 table, predicted from its single-GPU step
    without DDP, parameter and tensor counts and the DGX-1 presets (the model's
    constants are measured here or taken from datasheets, not fitted to these rows)."""
    rows = published.read_rows(PUBLISHED_CSV)
    assert {r.model for r in rows} >= {"resnet50", "resnext50_32x4d"}
    for row in rows:
        predicted = published.predict_row(row)
        assert [c.gpus for c in predicted] == [1, 2, 4, 8, 16], row.model
        for c in predicted:
            assert abs(c.error) <= 0.03, (c, published.command(row))


# ------------------------------------------------------------------------- validate
def test_validate_pipeline_on_two_ranks(pools):
    spec = validate.MlpSpec(widths=(64, 128, 10), batch_per_rank=8, steps=3, warmup=1,
                            calibration_sizes=(4096, 1 << 20))
    measured = validate.Measured(**pools(2).run(validate.measure_rank, spec)[0])
    assert measured.step_s > 0 and measured.backward_s > 0 and len(measured.step_samples) == 3
    assert [n for n, _ in measured.allreduce_points] == [4096, 1 << 20]
    assert all(t > 0 for _, t in measured.allreduce_points)
    cal = Calibration(2, 100e-6, 1e9, ((4096, 1e-3), (1 << 20, 2e-3)))
    pred = validate.predict(measured, cal, spec, overlap=0.0)
    assert sum(pred.buckets) == sum(measured.param_bytes) == 4 * (64 * 128 + 128 + 128 * 10 + 10)
    assert pred.step_s == pytest.approx(measured.forward_s + measured.backward_s
                                        + measured.optimizer_s + pred.comm_s)
    assert math.isfinite(pred.efficiency)
