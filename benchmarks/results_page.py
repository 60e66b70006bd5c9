"""benchmarks/RESULTS.md, written from benchmarks/RESULTS-data.json (``run_all.py``'s
figures): one headline table, a row per question a user asks, then one short section per
question with every figure, its command and its date.

A row's answer is the median over its runs with the min-max after it. A row whose
figures are not regenerated here (no GPU on this machine; a question not run yet) gives
its last figures with their date and says so; a row measured apart from the last sitting
(``run_all.py --only``) gives its own date.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
HISTORY = "RESULTS-history.md"


def stats(runs: list[dict], name: str) -> tuple[float, float, float, int] | None:
    values = [r[name] for r in runs if name in r]
    if not values:
        return None
    return statistics.median(values), min(values), max(values), len(values)


def cell(runs: list[dict], name: str, fmt: str = "{:.2f}", unit: str = "") -> str:
    """'0.56x (0.55-0.57)': the median, then min-max over the runs ('-' if missing)."""
    s = stats(runs, name)
    if s is None:
        return "-"
    med, lo, hi, n = s
    text = fmt.format(med) + unit
    return text if n == 1 else f"{text} ({fmt.format(lo)}-{fmt.format(hi)})"


@dataclass(frozen=True)
class Row:
    key: str  # the question's key in the data (its section's anchor)
    question: str
    answer: Callable[[list[dict]], str]


def _ddp(r):
    return (f"**{cell(r, 'ddpkit / torch DDP', unit='x')}** torch DDP's step; "
            f"{cell(r, 'ddpkit / compute ceiling', unit='x')} the compute ceiling's step "
            f"(torch DDP: {cell(r, 'torch DDP / compute ceiling', unit='x')})")


def _all_reduce(r):
    return "; ".join(f"{size}: **{cell(r, f'{size} speed-up over gloo', '{:.1f}', 'x')}**"
                     for size in ("1 KiB", "64 KiB", "1 MiB", "32 MiB")) + " faster"


def _peer(r):
    return "; ".join(f"{size}: **{cell(r, f'{size} ddpkit / DeepSpeed', unit='x')}**"
                     for size in ("1 KiB", "64 KiB", "1 MiB", "32 MiB")) + " DeepSpeed's time"


def _zero(stage):
    def answer(r):
        return (f"memory **{cell(r, f'{stage} memory / DDP', unit='x')}** DDP's, "
                f"{cell(r, f'{stage} memory / torch ZeRO', unit='x')} torch ZeRO's; step "
                f"**{cell(r, f'{stage} step / DDP', unit='x')}** DDP's, "
                f"{cell(r, f'{stage} step / torch ZeRO', unit='x')} torch ZeRO's")
    return answer


def _exact(r):
    return (f"V = W: **{cell(r, '8.4M MLP, V = W / default', unit='x')}** the default "
            f"step; V = 8: **{cell(r, '8.4M MLP, V = 8 / default', unit='x')}**")


def _frameworks(r):
    return "; ".join(f"{label}: **{cell(r, f'{name} ddpkit / torch DDP', unit='x')}**"
                     for name, label in (("trainer", "HF Trainer"),
                                         ("accelerate", "Accelerate"),
                                         ("lightning", "Lightning"))) + " torch DDP's step"


def _checkpoint(r):
    return (f"save **{cell(r, 'save ddpkit / torch', unit='x')}** `dcp.save`, load "
            f"**{cell(r, 'load ddpkit / torch', unit='x')}** `dcp.load` "
            f"({cell(r, 'save ddpkit s', unit=' s')} / {cell(r, 'load ddpkit s', unit=' s')})")


def _elastic(r):
    ok = sum(x.get("runs ok", 0) for x in r)
    return (f"lost host survived in {ok:.0f}/{len(r)} runs: **"
            f"{cell(r, 'to training s', '{:.1f}', ' s')}** from the kill to training again")


def _chaos(r):
    s = r[0] if r else {}
    return (f"**{s.get('as required', 0):.0f} of {s.get('scenarios', 0):.0f}** scenarios as "
            f"required (one run of each, {s.get('wall s', 0) / 60:.0f} min)")


def _tests(r):
    return (f"**{cell(r, 'tests', '{:.0f}')} tests** collected now; the whole suite last "
            f"timed {SUITE_TIMED}")


SUITE_TIMED = ("2026-11-29 06:58-07:15 UTC (not in this sitting; a fresh clone's `./.ci/run` "
               "at 3f669c7 on this machine, otherwise idle): 1410 passed, pytest 15 min 03 s")

ROWS = (
    Row("ddp-step", "DDP step (8.4M MLP, 2 ranks): against torch DDP and the compute ceiling",
        _ddp),
    Row("all-reduce", "All-reduce, `ddpkit.comm.all_reduce` against gloo (2 ranks)",
        _all_reduce),
    Row("peer", "All-reduce, ddpkit's time against DeepSpeed's shm op "
        "(`inference_all_reduce`)", _peer),
    Row("zero", "ZeRO-1 (`shard=\"optimizer\"`), 14.2M MLP, AdamW", _zero("ZeRO-1")),
    Row("zero", "ZeRO-2 (`shard=\"gradients\"`)", _zero("ZeRO-2")),
    Row("zero", "ZeRO-3 (`shard=\"parameters\"`)", _zero("ZeRO-3")),
    Row("exact", "Exact mode (8.4M MLP, global batch 1024): one slice per rank, 8 slices",
        _exact),
    Row("frameworks", "Frameworks unchanged on ddpkit against torch DDP", _frameworks),
    Row("checkpoint", "Checkpoint save / load (14.2M MLP + AdamW) against torch DCP",
        _checkpoint),
    Row("elastic", "Elastic: one of 3 hosts killed mid-run", _elastic),
    Row("chaos", "Chaos run: `ddpkit train` under every fault", _chaos),
    Row("tests", "Test suite", _tests),
)

# A row run_all.py has not measured yet: its last figures measured by hand, dated.
FALLBACK = {
    "peer": "not rerun (no DeepSpeed given: `--peer-python`); last measured 2026-11-25, "
            "one run: ddpkit 47 / 64 / 307 / 14114 us, DeepSpeed 12 / 27 / 209 / 21701 us at "
            "1 KiB / 64 KiB / 1 MiB / 32 MiB",
    "chaos": "not rerun here; last run 2026-11-28 08:16-08:28 UTC (`--runs 1`): 28 of 28 "
             "scenarios as required",
}

# The GPU check's row: not regenerated here (no GPU), its last run's figures and date.
GPU_ROW = ("GPU check (one H200)",
           "not rerun (no GPU here); last run 2026-11-28: every item ok and bitwise; "
           "DataParallel 0.93x torch DDP's step; exact mode V = 1 1.28x, V = 8 7.69x the "
           "default")


def anchor(key: str) -> str:
    """The section's anchor: GitHub's, from its title."""
    return TITLES[key].lower().replace(" ", "-")


def _in_sitting(data: dict, entry: dict) -> bool:
    sitting = data.get("sitting", {})
    return sitting.get("started", "") <= entry.get("started", "") <= sitting.get("finished", "")


def _headline(data: dict) -> list[str]:
    q = data["questions"]
    lines = ["| question | answer: median (min-max) | runs | details |", "|---|---|---|---|"]
    for row in ROWS:
        if row.key == "tests":  # the GPU check's row goes before the suite's
            lines.append(f"| {GPU_ROW[0]} | {GPU_ROW[1]} | - | "
                         f"[GPU check](#{anchor('gpu-check')}) |")
        entry = q.get(row.key, {})
        runs = entry.get("runs", [])
        answer = row.answer(runs) if runs else FALLBACK.get(row.key, "not measured yet")
        if runs and not _in_sitting(data, entry):
            answer += f" (measured apart from the sitting, {entry['started']})"
        lines.append(f"| {row.question} | {answer} | {len(runs) or '-'} | "
                     f"[{TITLES[row.key]}](#{anchor(row.key)}) |")
    return lines


TITLES = {"ddp-step": "DDP step", "all-reduce": "All-reduce", "peer": "Against DeepSpeed",
          "zero": "ZeRO",
          "exact": "Exact mode", "frameworks": "Frameworks", "checkpoint": "Checkpoint",
          "elastic": "Elastic", "chaos": "Chaos run", "tests": "Test suite",
          "gpu-check": "GPU check"}


def _num(v: float) -> str:
    """Three or four significant digits, never an exponent."""
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"


def _figures(runs: list[dict]) -> list[str]:
    names = list(dict.fromkeys(k for r in runs for k in r))
    lines = ["| figure | median | min | max | runs |", "|---|---|---|---|---|"]
    for name in names:
        med, lo, hi, n = stats(runs, name)
        lines.append(f"| {name} | {_num(med)} | {_num(lo)} | {_num(hi)} | {n} |")
    return lines


def section(key: str, about: str, entry: dict | None, extra: str = "") -> list[str]:
    lines = [f"## {TITLES[key]}", "", about, ""]
    if entry:
        lines += _figures(entry["runs"])
        lines += ["", f"`{entry['command']}` ({entry['launches']} launch"
                  f"{'es' if entry['launches'] > 1 else ''}), {entry['started']}, "
                  f"{entry['wall_s'] / 60:.1f} min, load average "
                  f"{entry['load'][0]:.1f}-{entry['load'][1]:.1f}."]
    else:
        lines.append("Not measured yet: `python benchmarks/run_all.py --only " + key + "`.")
    if extra:
        lines += ["", extra]
    return lines + [""]


ABOUT = {
    "ddp-step":
        "One training step (zero_grad, forward, backward, SGD) of an 8.4M-parameter MLP, "
        "batch 64 per rank, 2 gloo ranks, 1 thread each; the variants run side by side in "
        "the same processes, taking turns in a fresh order (`benchmarks/ddp_step.py`); a run "
        "is one turn: the median of its timed steps of each variant. The "
        "compute ceiling is the same step on 2 processes that never communicate (they "
        "still share the machine's memory bandwidth). Ratios are step times: below 1 is "
        "faster. \"parameters == torch DDP\": 1 when ddpkit's parameters were bitwise torch "
        "DDP's after the run. Why the engine is built as it is: "
        "[docs/architecture.md](../docs/architecture.md).",
    "all-reduce":
        "Time of one `ddpkit.comm.all_reduce(t)` (the default path, its checks included) "
        "against `torch.distributed.all_reduce` on gloo, float32, 2 ranks of this machine; "
        "the median call of each size, slowest rank (`ddpkit bench shm`, which also times "
        "the shared-memory engine alone: see its JSON). Speed-up = gloo's time / ddpkit's.",
    "peer":
        "DeepSpeed 0.19.8's C++ shared-memory all-reduce (`deepspeed.comm.inference_all_reduce`, "
        "its shm op built and engaged) beside `ddpkit.comm.all_reduce(t)` and gloo, float32, "
        "2 ranks (`shared/tools/peer_shm_bench.py` beside the repository, interleaved, "
        "median of 5; "
        "DeepSpeed is no dependency of ddpkit: a scratch environment with it is given to "
        "`run_all.py --peer-python`). Ratios are ddpkit's time / DeepSpeed's: below 1, "
        "ddpkit is faster.",
    "zero":
        "A 14.2M-parameter MLP, AdamW (fp32), batch 32 per rank, 2 ranks, each variant in "
        "fresh processes (`benchmarks/zero.py`). Memory: the largest rank's peak RSS "
        "growth over the built model (gradients, optimizer state, temporaries; the "
        "weights themselves are in the model). DDP is `DataParallel(model)`; torch ZeRO is "
        "torch DDP with `ZeroRedundancyOptimizer(AdamW)`. Ratios below 1: less memory or "
        "a faster step. The stages' design: [docs/sharding.md](../docs/sharding.md).",
    "exact":
        "Exact mode (`DataParallel(model, exact=True)`: the same bits at any world size) "
        "against the default mode at the same global batch, 2 ranks, side by side in the "
        "same processes (`benchmarks/exact_step.py`): one slice per rank (V = W, the sum "
        "alone) and 8 slices (V = 8, more and smaller passes); also the main job's small "
        "MLP (global batch 128). \"replicas ==\": 1 when both ranks ended bitwise equal. "
        "How it works and what it costs: [docs/exact.md](../docs/exact.md).",
    "frameworks":
        "The programs of `tests/framework_programs` (a transformers `Trainer` on a 2-layer "
        "BERT, Accelerate, a Lightning `Trainer(strategy=\"ddp\")`), unchanged, 2 CPU ranks, "
        "under `ddpkit launch` and under `torchrun` with torch DDP, taking turns "
        "(`benchmarks/frameworks.py`): the median time between optimizer steps on rank 0. "
        "[docs/frameworks.md](../docs/frameworks.md).",
    "checkpoint":
        "The same state (a 14.2M-parameter MLP in `DataParallel`, AdamW after one step, 2 "
        "gloo ranks) saved and loaded by ddpkit (`Checkpointer.save(collect_state(...))`, "
        "`load_latest` + `restore_state`: DCP files plus RNG states, a hashed manifest, "
        "every hash checked on load) and by torch's `dcp.save` / `dcp.load` of the "
        "module's and optimizer's state dicts, taking turns (`benchmarks/checkpoint_dcp.py`); "
        "rank 0's clock between barriers. A run is one save and one load of each way, 4 "
        "in the same processes. [docs/checkpoints.md](../docs/checkpoints.md).",
    "elastic":
        "Three test hosts (network namespaces on one switch) run `ddpkit train --nnodes "
        "2:3` in exact mode; after step 34 every process of host 3 is killed "
        "(`benchmarks/elastic.py`, as root). \"to resumed\": from the kill to the change "
        "line on a survivor (workers restarted, checkpoint restored); \"to training\": to "
        "its first step after it. A run is ok when every launcher exits 0, the final "
        "weights are `torch.equal` to the uninterrupted run's and every step was trained "
        "once. The other scenarios (cut off, grow, etcd): `benchmarks/elastic.py` and "
        "[docs/multinode.md](../docs/multinode.md).",
    "chaos":
        "`ddpkit train` (2 processes, 750 steps, a checkpoint every 25) under each fault "
        "a real job meets, inflicted from outside and rerun where the run can go on "
        "(`benchmarks/chaos.py`, as root). As required: the final weights `torch.equal` "
        "to an uninterrupted run's or the documented refusal, every process gone, no "
        "shared-memory segment left, only loopback sockets, no traceback storm. Row by "
        "row: [docs/reliability.md](../docs/reliability.md).",
    "tests":
        "The count is pytest's collection of `tests/` in this sitting. The suite is not "
        "run here (it needs the whole machine for a quarter of an hour); its last full run: "
        + SUITE_TIMED + ", `./.ci/run` 990 s of wall, 1476 + 250 CPU-s.",
}

# The GPU check's last run, kept as measured (no GPU here to rerun it).
GPU_SECTION = os.path.join(ROOT, "benchmarks", "data", "gpu_check_h200.md")


def render(data: dict) -> str:
    q = data.get("questions", {})
    m = data.get("machine", {})
    sitting = data.get("sitting", {})
    inside = [e for e in q.values() if "started" in e and _in_sitting(data, e)]
    loads = [e["load"] for e in inside]
    dates = sorted(e["started"] for e in inside)
    lines = [
        "# Results", "",
        "What ddpkit costs and saves, one row per question; every timed row is the median "
        "of at least 3 runs with its min-max, regenerated in one sitting by",
        "",
        "```sh",
        "flock /tmp/ddpkit-heavy.lock .venv/bin/python benchmarks/run_all.py",
        "```",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores shared with other work, "
        f"torch {m.get('torch', '?')}, Python {m.get('python', '?')}, no GPU. "
        + (f"Last sitting: {dates[0]} to {sitting.get('finished', '?')} "
           f"({sitting.get('wall_s', 0) / 60:.0f} min), load average "
           f"{min(lo for lo, _ in loads):.1f}-{max(hi for _, hi in loads):.1f} "
           "(on 2 cores: figures move with it; compare the rows of one table, measured side "
           "by side). " if dates else "")
        + "Rows marked \"not rerun\" keep their date. Earlier measurements, designs tried "
        f"and dropped, and the derivations behind the code's constants: [{HISTORY}]({HISTORY}).",
        "", "## Headline", "",
    ]
    lines += _headline(data) + [""]
    for key in ("ddp-step", "all-reduce", "peer", "zero", "exact", "frameworks", "checkpoint",
                "elastic", "chaos", "tests"):
        lines += section(key, ABOUT[key], q.get(key), FALLBACK.get(key, "") if
                         key not in q else "")
    with open(GPU_SECTION) as fh:
        gpu = fh.read().rstrip("\n")
    lines += [f"## {TITLES['gpu-check']}", "", gpu]
    return "\n".join(lines) + "\n"
