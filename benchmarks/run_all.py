"""Regenerate benchmarks/RESULTS.md: one table per question, each with its command and
date.

    .venv/bin/python benchmarks/run_all.py                 # every question (~7 min on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick         # fewer repeats: minutes, noisier
    .venv/bin/python benchmarks/run_all.py --only cost-model-published,ddp-step
    .venv/bin/python benchmarks/run_all.py --list          # the questions and their commands

Each question is one entry of QUESTIONS: a key, a title, what it answers, the command
to run (full and --quick settings) and a function turning its output into one table.
Run under the shared lock on a shared machine (``flock /tmp/ddpkit-heavy.lock ...``).

RESULTS.md is rewritten section by section: the text between ``<!-- section: KEY -->``
and ``<!-- end: KEY -->`` is this script's; everything else on the page (an introduction,
sections written by hand) is kept as it is. A question whose section is missing is
appended. To add a question: write its benchmark so it prints or writes its figures,
then add a Question with a ``rows`` function here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
BIN = os.path.dirname(sys.executable)


@dataclass(frozen=True)
class Step:
    """One command: ``argv`` with ``{out}`` standing for a scratch directory; ``quick``
    replaces options for --quick (appended: argparse takes the last value)."""

    argv: tuple[str, ...]
    quick: tuple[str, ...] = ()

    def command(self, quick: bool) -> list[str]:
        return [*self.argv, *(self.quick if quick else ())]


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: list[tuple] = field(default_factory=list)
    note: str = ""  # one paragraph under the table
    # (label, command) where rows come from different commands (each model's prediction)
    row_commands: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Question:
    key: str
    title: str
    answers: str  # what the table answers, in a sentence or two
    step: Step
    table: Callable[[str, str], Table]  # (the command's stdout, scratch dir)


# ------------------------------------------------------------------- table makers
def _float(text: str) -> float:
    return float(text.replace(",", ""))


def main_job_table(out: str, _dir: str) -> Table:
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and all(re.fullmatch(r"[\d.]+|nan", p) for p in parts[:5]):
            _rundir, train, _done, wall, acc = map(float, parts[:5])
            rows.append((f"{acc:.2f} %", f"{train:.2f} s", f"{wall:.2f} s"))
    imports = next((line for line in out.splitlines() if line.startswith("import ddpkit")), "")
    load = [line for line in out.splitlines() if line.startswith("load average")]
    return Table(("test accuracy", "training loop", "wall, command to exit"), rows,
                 f"{imports}. {'; '.join(load)}.")


def collectives_table(_out: str, scratch: str) -> Table:
    with open(os.path.join(scratch, "coll", "collectives-all_reduce.json")) as fh:
        data = json.load(fh)["rows"]
    by = {(r["algo"], r["bytes"]): r for r in data}
    algos = [a for a in ("shm", "ring", "backend") if any(k[0] == a for k in by)]
    rows = []
    for size in sorted({r["bytes"] for r in data}):
        gloo = by[("backend", size)]["time_us"]
        rows.append((_human(size), *(f"{by[(a, size)]['time_us']:.0f} us, "
                                     f"{by[(a, size)]['busbw_gbps']:.2f} GB/s, "
                                     f"{gloo / by[(a, size)]['time_us']:.2f}x" for a in algos)))
    names = {"backend": "gloo (torch)", "shm": "shm", "ring": "ring"}
    return Table(("size", *(f"{names[a]}: time, busbw, x gloo" for a in algos)), rows,
                 "All-reduce of float32 on 2 ranks of this machine; median round, slowest "
                 "rank. shm is the default (`algo=\"auto\"`) for CPU tensors on one host.")


def collectives_latency_table(out: str, _dir: str) -> Table:
    small = []
    for line in out.splitlines():
        found = re.match(r"^\s*(\S+)\s+(comm|gloo|shm|shm-copy|shm-signed|comm-nocheck)\s+"
                         r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if found:
            small.append(found.groups())
    by_small: dict[str, dict[str, tuple]] = {}
    for size, algo, t, bw, x in small:
        by_small.setdefault(size, {})[algo] = (t, bw, x)
    shm_cols = ("gloo", "comm", "shm-copy", "shm")
    shm_rows = [(size, *(f"{v[algo][0]} us, {v[algo][2]}x" if algo in v else "-"
                         for algo in shm_cols)) for size, v in by_small.items()]
    verdicts = [line for line in out.splitlines() if line.startswith(("target", "in-band"))]
    return Table(("size", "gloo", "ddpkit.comm.all_reduce(t) (default)",
                  "shm engine, private tensor", "shm engine, tensor in the segment"), shm_rows,
                 "Time per call and speed-up over gloo. " + " ".join(
                     f"{v.rstrip('.')}." for v in verdicts))


def ddp_step_table(_out: str, scratch: str) -> Table:
    with open(os.path.join(scratch, "ddp_step.json")) as fh:
        data = json.load(fh)
    names = {"single": "one process alone", "local": "2 processes, no communication "
             "(the compute ceiling)", "torch": "torch DDP", "torch_gbv":
             "torch DDP, gradient_as_bucket_view", "torch_shm": "torch DDP + ddpkit's shm hook",
             "ddpkit": "ddpkit.DataParallel (defaults)"}

    def num(v):
        return "-" if v is None else f"{v:.3f}"

    rows = [(names.get(r["variant"], r["variant"]), f"{r['median_ms']:.1f}", num(r["vs_torch"]),
             num(r["efficiency_vs_single"]), num(r["efficiency_vs_local"]),
             {True: "yes", False: "no", None: "-"}[r["bitwise_equal_to_torch"]])
            for r in data["rows"]]
    return Table(("variant", "step ms", "time / torch DDP", "scaling efficiency",
                  "of the compute ceiling", "parameters == torch DDP"), rows,
                 f"MLP of {data['model_params'] / 1e6:.1f} M parameters, batch "
                 f"{data['batch_per_rank']} per rank, {data['world_size']} gloo ranks, 1 thread "
                 "each; median step (zero_grad, forward, backward, SGD). Scaling efficiency = "
                 "one process's step / this step; of the compute ceiling = the step of 2 "
                 "processes that do not communicate / this step (2 ranks share this "
                 "machine's memory bandwidth). Load average "
                 f"{data['loadavg_before'][0]:.1f} before, {data['loadavg_after'][0]:.1f} "
                 "after.")


def fault_table(out: str, _dir: str) -> Table:
    rows = []
    for line in out.splitlines():
        found = re.match(r"^(.+?)\s+([\d.]+)\s+([\d.]+)$", line)
        if found and not line.startswith("checkpoint"):
            rows.append((found.group(1), f"{found.group(2)} us", f"{found.group(3)} us"))
        elif line.startswith("checkpoint"):
            what, _, figure = line.partition(": ")
            rows.append((what, figure, ""))
    return Table(("operation", "median", "p90"), rows,
                 "2 gloo ranks over a TCPStore; rank 0's timings.")


def published_table(out: str, _dir: str) -> Table:
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] not in ("model", "---"):
            rows.append(tuple(cells))
    commands = [line.strip() for line in out.splitlines()
                if line.startswith("    ddpkit plan project")]
    params = {}
    with open(os.path.join(ROOT, "benchmarks", "data", "torch_ddp_v100_published.csv")) as fh:
        for line in fh.read().splitlines():
            if line[:1] not in ("#", "m") and "," in line:
                name, count = line.split(",")[:2]
                params[count] = name
    labelled = tuple((params.get(cmd.split("--params ")[1].split()[0], "?"), cmd)
                     for cmd in commands)
    worst = next((line for line in out.splitlines() if line.startswith("Worst")), "")
    return Table(("model", "GPUs", "published step", "predicted", "error",
                  "error without the slowest-device term"), rows,
                 f"{worst.split('. Commands')[0]}. Each row is predicted from the model's "
                 "single-GPU step without DDP, its parameter and tensor counts, and the DGX-1 "
                 "presets (the fastest algorithm's row of plan.csv). resnet101 and "
                 "resnext101_32x8d were compared only after the model's constants were fixed. "
                 "The slowest-device spread (2.5%) is an assumption, not measured here (no "
                 "GPU) and not fitted; the intra-node link of a job on a few of a DGX-1's "
                 "GPUs is the NVLinks among them (docs/multinode.md).",
                 row_commands=labelled)


def ddp_overhead_table(out: str, _dir: str) -> Table:
    rows = []
    for line in out.splitlines():
        found = re.match(r"^\s+(\S+=\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)ms\s+([\d.]+)ms$", line)
        if found:
            rows.append((found.group(1), found.group(2), found.group(3),
                         f"{found.group(4)} ms", f"{found.group(5)} ms"))
    fit = next((line for line in out.splitlines() if line.startswith("per tensor")), "")
    return Table(("model", "tensors", "MiB", "step without DDP", "DDP's extra"), rows,
                 f"DDP's own per-step work, measured with torch DDP on one gloo rank: {fit}. "
                 "The model's constants (src/ddpkit/plan/model.py: 18 us per tensor, 4.2 "
                 "passes) were set from an earlier run of this benchmark (2026-11-25 13:52 "
                 "UTC, 5 rounds: 18.2 us, 4.2 passes); this run shows how much they move "
                 "between runs on a loaded machine.")


def plan_validate_table(_out: str, scratch: str) -> Table:
    with open(os.path.join(scratch, "validate.json")) as fh:
        validate = json.load(fh)["results"]
    rows = [(r["batch_per_rank"], f"{r['measured_step_s'] * 1e3:.1f} ms",
             f"{r['predicted_step_s'] * 1e3:.1f} ms", f"{r['error']:+.1%}") for r in validate]
    return Table(("batch per rank", "measured DDP step", "predicted", "error"), rows,
                 "`ddpkit plan validate` on this machine: torch DDP on 2 gloo ranks, MLP "
                 "1024-2048-2048-2048-10, prediction from the no-communication step and an "
                 "all-reduce line fitted in the same processes (no DDP-overhead term here).")


def _human(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


PY = os.path.join(BIN, "python")
DDPKIT = os.path.join(BIN, "ddpkit")

QUESTIONS: tuple[Question, ...] = (
    Question(
        "main-job", "Main job: how long, how accurate",
        "`ddpkit train` with its defaults (digits, MLP, 2 CPU processes, 20 epochs): test "
        "accuracy, the training loop's time, and the wall time of the whole command (most "
        "of it starting the agent and two workers that import torch).",
        Step((PY, "benchmarks/startup.py", "--runs", "3"), ("--runs", "1")),
        main_job_table),
    Question(
        "collectives", "All-reduce bandwidth: ddpkit against gloo",
        "All-reduce time and bus bandwidth of ddpkit's algorithms against torch's gloo on "
        "one host, from large messages to the small ones where latency rules.",
        Step((DDPKIT, "bench", "collectives", "--nproc", "2", "--op", "all_reduce",
              "--algo", "shm,ring,backend", "--sizes", "64K:64M:4", "--out-dir", "{out}/coll",
              "--no-plot"), ("--sizes", "64K:4M:8", "--repeats", "3")),
        collectives_table),
    Question(
        "collectives-latency", "All-reduce time per call: the default, the shm engine, gloo",
        "Time of one `ddpkit.comm.all_reduce(t)` call (the default path, its checks "
        "included) and of the shared-memory engine alone, against gloo, from 4 bytes up.",
        Step((DDPKIT, "bench", "shm", "--out-dir", "{out}/shm", "--no-plot"),
             ("--sizes", "4,64K,4M", "--budget", "0.1")),
        collectives_latency_table),
    Question(
        "ddp-step", "DDP step: ddpkit against torch DDP, and against the compute ceiling",
        "One training step of an 8.4 M-parameter MLP on 2 CPU ranks under each engine, run "
        "side by side in the same processes.",
        Step((PY, "benchmarks/ddp_step.py", "--json", "{out}/ddp_step.json"),
             ("--rounds", "3", "--steps", "3", "--warmup", "1")),
        ddp_step_table),
    Question(
        "fault-tolerance", "Fault tolerance: what the hooks and checkpoints cost",
        "Per-call cost of the hang watchdog and the preemption check, and a checkpoint's "
        "save and verified load.",
        Step((PY, "benchmarks/fault_overhead.py"), ("--iters", "200", "--mib", "16")),
        fault_table),
    Question(
        "cost-model-published", "Cost model against torch DDP's published V100 table",
        "`ddpkit plan project` held to every row of the step times PyTorch published for "
        "torch DDP on DGX-1 machines.",
        Step((PY, "benchmarks/plan_published.py")),
        published_table),
    Question(
        "cost-model-overhead", "Cost model: DDP's own work per step",
        "The measurement behind the model's DDP-overhead term: what torch DDP adds to a "
        "step on a process group of one, by tensor count and by gradient bytes.",
        Step((PY, "benchmarks/ddp_overhead.py"), ("--rounds", "5", "--steps", "3")),
        ddp_overhead_table),
    Question(
        "cost-model-validate", "Cost model against a measured DDP step here",
        "`ddpkit plan validate`: the model's prediction of a torch DDP step on this "
        "machine against the step measured.",
        Step((DDPKIT, "plan", "validate", "--out", "{out}/validate.json"), ("--steps", "4")),
        plan_validate_table),
)


# ------------------------------------------------------------------- the page
def shown(argv: Sequence[str]) -> str:
    """A command as a reader types it from the repository root."""
    words = [("ddpkit" if w == DDPKIT else "python" if w == PY else w.replace("{out}", "OUT"))
             for w in argv]
    return shlex.join(words)


def render(q: Question, table: Table, command: str, date: str) -> str:
    """The question's section: its title, what it answers, the table, a note, and the
    command and date that produced it (each model's command where rows differ in it)."""
    lines = [f"<!-- section: {q.key} -->", f"### {q.title}", "", q.answers, ""]
    lines.append("| " + " | ".join(table.columns) + " |")
    lines.append("|" + "---|" * len(table.columns))
    for row in table.rows or [tuple("-" for _ in table.columns)]:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    if table.note:
        lines += ["", table.note]
    lines += ["", f"Measured {date}: `{command}`"
              + (", each model's rows by:" if table.row_commands else "")]
    if table.row_commands:
        lines.append("")
        lines += [f"* {label}: `{cmd}`" for label, cmd in table.row_commands]
    lines += ["", f"<!-- end: {q.key} -->"]
    return "\n".join(lines)


def replace_section(page: str, key: str, text: str) -> str:
    pattern = re.compile(rf"<!-- section: {re.escape(key)} -->.*?<!-- end: {re.escape(key)} -->",
                         re.S)
    if pattern.search(page):
        return pattern.sub(lambda _m: text, page)
    return page.rstrip("\n") + "\n\n" + text + "\n"


def run_question(q: Question, quick: bool) -> str:
    with tempfile.TemporaryDirectory(prefix=f"ddpkit-results-{q.key}-") as scratch:
        argv = [a.replace("{out}", scratch) for a in q.step.command(quick)]
        command = shown(q.step.command(quick))
        print(f"[{q.key}] {command}", file=sys.stderr, flush=True)
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"[{q.key}] failed (exit {proc.returncode}): {command}\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        return render(q, q.table(proc.stdout, scratch), command, date)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (noisier figures)")
    p.add_argument("--only", default=None, help="comma-separated question keys")
    p.add_argument("--list", action="store_true", help="print the questions and commands")
    p.add_argument("--page", default=RESULTS, help="the page to update (default: %(default)s)")
    args = p.parse_args(argv)
    chosen = list(QUESTIONS)
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = [k for k in keys if k not in {q.key for q in QUESTIONS}]
        if unknown:
            p.error(f"--only {','.join(unknown)}: not a question; known: "
                    f"{', '.join(q.key for q in QUESTIONS)}")
        chosen = [q for q in QUESTIONS if q.key in keys]
    if args.list:
        for q in chosen:
            print(f"{q.key}: {q.title}")
            print(f"    {shown(q.step.command(args.quick))}")
        return 0
    page = ""
    if os.path.exists(args.page):
        with open(args.page) as fh:
            page = fh.read()
    for q in chosen:
        page = replace_section(page, q.key, run_question(q, args.quick))
        with open(args.page, "w") as fh:  # after each question: a failure keeps the rest
            fh.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
