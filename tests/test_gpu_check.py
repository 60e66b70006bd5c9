"""benchmarks/gpu_check.py, the command prepared for a CUDA machine, checked where there
is none: its dry run (every item skipped, exit 0, the JSON and the table written), its
CPU rehearsal (every item's code at tiny sizes, gloo in place of NCCL: every item ok and
every bitwise comparison really comparing tensors, with 0 difference), and the
comparison it records."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402
from gpu_check_lib import Layout, Report, difference  # noqa: E402

NAMES = [item.name for item in gpu_check.ITEMS]
BITWISE_ITEMS = ("ddp_vs_torch", "comm_nccl", "comm_gloo", "zero", "exact", "exact_sum")


@pytest.mark.unit
def test_dry_run_reports_every_item_skipped_and_writes_the_json_and_the_table(tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    reason = "dry run" if torch.cuda.is_available() else "no CUDA device"
    assert [e["name"] for e in report["items"]] == NAMES
    assert all(e["status"] == "skipped" and e["reason"] == reason for e in report["items"])
    assert report["exit_code"] == 0 and report["mode"] == "dry run"
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["date_utc"].endswith("UTC")
    table = (tmp_path / "gpu_check.md").read_text()
    for name in NAMES:
        assert f"| {name} |" in table
    assert table.count(f"skipped: {reason}") == len(NAMES)


@pytest.mark.unit
def test_every_planned_item_has_its_code():
    import gpu_check_items

    assert sorted(NAMES) == sorted(gpu_check_items.ITEMS)


@pytest.mark.unit
def test_a_difference_of_one_ulp_is_found_and_fails_unless_the_reference_also_moves():
    a = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    b = [torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0))]),
         torch.tensor([3.0])]
    found = difference(b, a)
    assert not found["bitwise"] and 0 < found["max_abs_diff"] < 1e-6
    assert found["elements"] == 3 and difference(a, a)["bitwise"]
    assert not difference(a[:1], a)["bitwise"]  # a missing tensor is no match
    layout = Layout("gloo", ("cpu",))
    report = Report()
    report.compare("engines", layout, found, control=difference(a, a))
    assert report.failures and "not bitwise" in report.failures[0]
    report = Report()
    report.compare("engines", layout, found, control=found)  # the reference itself moves
    assert not report.failures and "not deterministic" in report.comparisons[0]["why"]


def test_rehearsal_runs_every_item_and_the_bits_match(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                           "--rehearse-on-cpu", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    items = {e["name"]: e for e in report["items"]}
    logs = {n: (tmp_path / "logs" / f"{n}.log").read_text()[-3000:] for n in NAMES
            if (tmp_path / "logs" / f"{n}.log").exists()}
    assert report["mode"] == "cpu rehearsal" and list(items) == NAMES
    for name, entry in items.items():
        assert entry["status"] == "ok", f"{name}: {entry.get('error')}\n{logs.get(name)}"
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for name in BITWISE_ITEMS:
        rows = items[name]["comparisons"]
        assert rows, name
        for row in rows:  # parameters (or results) really compared, and equal to the bit
            assert row["elements"] > 0 and row["tensors"] > 0, (name, row)
            assert row["bitwise"] and row["max_abs_diff"] == 0, (name, row)
    compared = {row["what"] for row in items["zero"]["comparisons"]}
    assert any("'gradients'" in w for w in compared) and any("'parameters'" in w
                                                            for w in compared)
    assert any("V=8" in row["what"] and "vs 1 process" in row["what"]
               for row in items["exact"]["comparisons"])
    for name in ("step_time", "exact"):
        assert items[name]["timings"] and all(t["median_ms"] > 0
                                              for t in items[name]["timings"]), name
    facts = items["main_job_bf16"]["facts"]
    assert facts["exit_code"] == 0 and facts["weights saved from"] == ["cpu"]
    assert 0 < facts["final_test_acc"] <= 1
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} |" in table for name in NAMES)
