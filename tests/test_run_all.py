"""benchmarks/run_all.py and the results page it writes: the parsers read what the
benchmarks really print, the spread is the runs' median and min-max, and the page keeps
its shape (one headline row per question, each leading to its section, <= 400 lines)."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import results_page  # noqa: E402
import run_all  # noqa: E402

from test_doc_links import anchors  # noqa: E402

PAGE = os.path.join(ROOT, "benchmarks", "RESULTS.md")
DATA = os.path.join(ROOT, "benchmarks", "RESULTS-data.json")


def test_a_cell_is_the_median_then_min_max_of_the_runs():
    runs = [{"x": 0.9}, {"x": 1.6}, {"x": 1.1}, {"y": 5.0}]  # mean 1.2, median 1.1
    assert results_page.cell(runs, "x", unit="x") == (
        f"{statistics.median([0.9, 1.6, 1.1]):.2f}x (0.90-1.60)")
    assert results_page.cell(runs, "y", "{:.1f}") == "5.0"  # one run: no spread to show
    assert results_page.cell(runs, "z") == "-"


def test_ddp_step_parser_reads_a_real_tiny_run(tmp_path):
    """A real (tiny) benchmarks/ddp_step.py run: one run per round, each ratio that
    round's medians' ratio."""
    out = tmp_path / "ddp_step.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/ddp_step.py", "--variants", "local,torch,ddpkit",
         "--sizes", "32-64-10", "--batch", "8", "--rounds", "3", "--steps", "2",
         "--warmup", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = run_all.parse_ddp_step(proc.stdout, str(tmp_path))
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(runs) == 3
    for i, run in enumerate(runs):
        ours, theirs = rows["ddpkit"]["round_medians_ms"][i], rows["torch"]["round_medians_ms"][i]
        assert run["ddpkit ms"] == ours and run["torch DDP ms"] == theirs
        assert run["ddpkit / torch DDP"] == pytest.approx(ours / theirs)
        assert run["parameters == torch DDP"] == 1.0  # ddpkit's bits are torch DDP's


def test_chaos_and_suite_parsers_read_the_summary_lines():
    chaos = "ok  x: ...\n\n28 scenarios, 2 bad, 702 s; 2026-11-28; disk-full scenarios run\n"
    assert run_all.parse_chaos(chaos, "") == [
        {"scenarios": 28, "as required": 26, "wall s": 702}]
    assert run_all.parse_tests("a.py::t\n\n1040 tests collected in 9.1s\n", "") == [
        {"tests": 1040}]
    with pytest.raises(ValueError):
        run_all.parse_tests("ERROR collecting\n", "")


def test_every_question_has_its_headline_row_and_section():
    keys = {q.key for q in run_all.QUESTIONS}
    assert keys == {r.key for r in results_page.ROWS}
    assert keys <= set(results_page.ABOUT)


def test_the_page_is_rendered_from_its_data_and_keeps_its_shape():
    with open(DATA) as fh:
        data = json.load(fh)
    with open(PAGE) as fh:
        page = fh.read()
    assert page == results_page.render(data), "RESULTS.md edited by hand: run run_all.py --render"
    lines = page.splitlines()
    assert len(lines) <= 400
    heads = anchors(Path(PAGE))
    start = lines.index("## Headline") + 2
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    assert len(table) - 2 >= len(results_page.ROWS)  # header and rule, then the rows
    for row in table[2:]:
        target = re.search(r"\]\(#([\w-]+)\) \|$", row)
        assert target and target.group(1) in heads, row
    # the words of a page that tells how the work went, not what it found
    # kept anchors, link targets and commands are not prose
    prose = re.sub(r'<a id="[^"]+"></a>|\]\([^)]*\)|`[^`]*`', "", page)
    assert not re.search(r"\b(sessions?|issues?|rounds?|helpers?)\b", prose, re.I)


def test_peer_parser_reads_the_peer_benchmarks_lines():
    out = ("deepspeed shm op: True kernel level 1\n"
           "     1024 B gloo=1788us(1.0x) deepspeed_shm=12us(155.1x) ddpkit_default=48us(37.2x)\n"
           "    65536 B gloo=1400us(1.0x) deepspeed_shm=27us(51.1x) ddpkit_default=64us(22.0x)\n"
           "  4194304 B gloo=4938us(1.0x) deepspeed_shm=1700us(2.9x) ddpkit_default=1740us(2.8x)\n")
    (figs,) = run_all.parse_peer(out, "")
    assert figs["1 KiB ddpkit / DeepSpeed"] == pytest.approx(48 / 12)
    assert figs["64 KiB gloo us"] == 1400 and figs["64 KiB DeepSpeed us"] == 27
    assert not any(k.startswith("4 MiB") for k in figs)  # not a headline size
    with pytest.raises(ValueError):
        run_all.parse_peer(out.replace("=64us(22.0x)", "=64us(22.0x)!WRONG"), "")
