"""Regenerate benchmarks/RESULTS.md: every timed row of its headline table, in one sitting.

    flock /tmp/ddpkit-heavy.lock .venv/bin/python benchmarks/run_all.py     # everything
    .venv/bin/python benchmarks/run_all.py --only ddp-step,checkpoint         # some rows
    .venv/bin/python benchmarks/run_all.py --list                             # the commands
    .venv/bin/python benchmarks/run_all.py --render                           # page from data

Each question of QUESTIONS names a benchmark command, how many times to run it, and a
parser turning one run's output into named figures (one dict per run; a benchmark that
repeats internally, as the elastic one, yields one dict per repeat). The figures of every
run go to benchmarks/RESULTS-data.json with the command, its date and the load average
around it; the page (benchmarks/results_page.py) is then written from that file alone:
the headline table (median and min-max over the runs) and one section per question. A
question not run this time keeps its last figures, with their date.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import results_page

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "benchmarks", "RESULTS-data.json")
PY = sys.executable
Figures = dict[str, float]
PEER = "{peer}"  # the --peer-python
# The peer benchmark lives in the workspace beside the repository, not in it.
PEER_BENCH = os.path.join(os.path.dirname(ROOT), "shared", "tools", "peer_shm_bench.py")


@dataclass(frozen=True)
class Question:
    key: str
    argv: tuple[str, ...]  # "{out}" stands for a fresh scratch directory per run
    runs: int  # fresh launches of argv; each parse may give several runs' figures
    parse: Callable[[str, str], list[Figures]]  # (stdout, scratch dir) -> runs' figures
    env: tuple[tuple[str, str], ...] = ()  # set for the command, beside OMP_NUM_THREADS=1


# ------------------------------------------------------------------- parsers
def _json(scratch: str, name: str):
    with open(os.path.join(scratch, name)) as fh:
        return json.load(fh)


def parse_ddp_step(_out: str, scratch: str) -> list[Figures]:
    """One run per round of the benchmark (the variants take turns within each)."""
    by = {r["variant"]: r for r in _json(scratch, "ddp_step.json")["rows"]}
    same = float(bool(by["ddpkit"]["bitwise_equal_to_torch"]))
    runs = []
    for ours, torch_, ceiling in zip(*(by[v]["round_medians_ms"]
                                       for v in ("ddpkit", "torch", "local"))):
        runs.append({"ddpkit ms": ours, "torch DDP ms": torch_, "compute ceiling ms": ceiling,
                     "ddpkit / torch DDP": ours / torch_,
                     "ddpkit / compute ceiling": ours / ceiling,
                     "torch DDP / compute ceiling": torch_ / ceiling,
                     "parameters == torch DDP": same})
    return runs


ALL_REDUCE_SIZES = {1 << 10: "1 KiB", 1 << 16: "64 KiB", 1 << 20: "1 MiB", 32 << 20: "32 MiB"}


def parse_all_reduce(_out: str, scratch: str) -> list[Figures]:
    by = {(r["algo"], r["bytes"]): r["time_us"] for r in _json(scratch, "shm/shm.json")}
    figs: Figures = {}
    for size, label in ALL_REDUCE_SIZES.items():
        gloo, ours = by[("gloo", size)], by[("comm", size)]
        figs.update({f"{label} gloo us": gloo, f"{label} ddpkit us": ours,
                     f"{label} speed-up over gloo": gloo / ours})
    return [figs]


ZERO_STAGES = {"dp_optimizer": "ZeRO-1", "dp_gradients": "ZeRO-2", "dp_parameters": "ZeRO-3"}


def parse_zero(_out: str, scratch: str) -> list[Figures]:
    by = {r["variant"]: r for r in _json(scratch, "zero.json")["rows"]}

    def mem(v):
        return max(by[v]["growth_mib_per_rank"])

    figs: Figures = {}
    for v, label in (("dp_none", "DDP"), ("torch_zero", "torch ZeRO"), *ZERO_STAGES.items()):
        figs[f"{label} step ms"] = by[v]["median_ms"]
        figs[f"{label} peak MiB"] = mem(v)
    for v, stage in ZERO_STAGES.items():
        for base, name in (("dp_none", "DDP"), ("torch_zero", "torch ZeRO")):
            figs[f"{stage} memory / {name}"] = mem(v) / mem(base)
            figs[f"{stage} step / {name}"] = by[v]["median_ms"] / by[base]["median_ms"]
    return [figs]


def parse_exact(_out: str, scratch: str) -> list[Figures]:
    figs: Figures = {}
    rows = _json(scratch, "exact_step.json")["rows"]
    for r in rows:
        model = "8.4M MLP" if r["model"] == "mlp8m" else "main job's MLP"
        name = {"default": "default", "exact_1pr": "V = W", "exact": f"V = {r['slices']}"}
        if r["variant"] in name:
            label = f"{model}, {name[r['variant']]}"
            figs[f"{label} ms"] = r["median_ms"]
            if r["variant"] != "default":
                figs[f"{label} / default"] = r["vs_default"]
                figs[f"{label} replicas =="] = float(r["replicas_equal"] is True)
    return [figs]


FRAMEWORK_ROW = re.compile(r"^\| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|")


def parse_frameworks(out: str, _scratch: str) -> list[Figures]:
    figs: Figures = {}
    for line in out.splitlines():
        found = FRAMEWORK_ROW.match(line)
        if found:
            name, torch_ms, ours_ms, _ = found.groups()
            figs[f"{name} torch DDP ms"] = float(torch_ms)
            figs[f"{name} ddpkit ms"] = float(ours_ms)
            figs[f"{name} ddpkit / torch DDP"] = float(ours_ms) / float(torch_ms)
    return [figs]


def parse_checkpoint(_out: str, scratch: str) -> list[Figures]:
    """One run per save and load of each way (they take turns within the processes)."""
    t = _json(scratch, "checkpoint.json")["times_s"]
    return [{**{f"{k} s": t[k][i] for k in t},
             "save ddpkit / torch": t["save ddpkit"][i] / t["save torch"][i],
             "load ddpkit / torch": t["load ddpkit"][i] / t["load torch"][i]}
            for i in range(len(t["save ddpkit"]))]


def parse_elastic(out: str, _scratch: str) -> list[Figures]:
    runs = []
    for line in out.splitlines():
        found = re.match(r"^shrink-kill #\d+: (\{.*\})$", line)
        if found:
            r = ast.literal_eval(found.group(1))
            runs.append({"runs ok": float(r.get("ok", False)),
                         **{k.replace("_s", " s").replace("_", " "): v for k, v in r.items()
                            if k in ("to_resumed_s", "to_training_s")}})
    return runs


def parse_chaos(out: str, _scratch: str) -> list[Figures]:
    found = re.search(r"^(\d+) scenarios, (\d+) bad, (\d+) s;", out, re.M)
    if not found:
        raise ValueError("no summary line in the chaos run's output")
    total, bad, seconds = map(int, found.groups())
    return [{"scenarios": total, "as required": total - bad, "wall s": seconds}]


PEER_ROW = re.compile(r"^\s*(\d+) B (.*)$")


def parse_peer(out: str, _scratch: str) -> list[Figures]:
    """peer_shm_bench.py's lines: ``1024 B gloo=1788us(1.0x) deepspeed_shm=12us(155.1x) ...``."""
    if "deepspeed shm op: True" not in out:  # else DeepSpeed's call is gloo's, no peer
        raise ValueError("DeepSpeed's shm op was not engaged (see peer_shm_bench.py's header)")
    figs: Figures = {}
    for line in out.splitlines():
        found = PEER_ROW.match(line)
        if found and int(found.group(1)) in ALL_REDUCE_SIZES:
            size = ALL_REDUCE_SIZES[int(found.group(1))]
            times = dict(re.findall(r"(\w+)=(\d+)us", found.group(2)))
            if "!WRONG" in line:
                raise ValueError(f"peer benchmark: a wrong all-reduce result at {size}")
            ours, theirs = float(times["ddpkit_default"]), float(times["deepspeed_shm"])
            figs.update({f"{size} gloo us": float(times["gloo"]),
                         f"{size} DeepSpeed us": theirs, f"{size} ddpkit us": ours,
                         f"{size} ddpkit / DeepSpeed": ours / max(theirs, 1.0)})
    if not figs:
        raise ValueError("no size line in the peer benchmark's output")
    return [figs]


def parse_tests(out: str, _scratch: str) -> list[Figures]:
    found = re.search(r"^(\d+) tests? collected", out, re.M)
    if not found:
        raise ValueError("no 'N tests collected' line in pytest's output")
    return [{"tests": int(found.group(1))}]


QUESTIONS: tuple[Question, ...] = (  # quick and side-by-side first, the long runs last
    Question("tests", (PY, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                       "tests"), 1, parse_tests),
    Question("ddp-step", (PY, "benchmarks/ddp_step.py", "--variants", "local,torch,ddpkit",
                          "--rounds", "5", "--steps", "3", "--warmup", "2",
                          "--json", "{out}/ddp_step.json"), 1, parse_ddp_step),
    Question("all-reduce", (PY, "-m", "ddpkit.cli", "bench", "shm",
                            "--sizes", "1K,64K,1M,32M", "--budget", "0.3",
                            "--out-dir", "{out}/shm", "--no-plot"), 3, parse_all_reduce),
    Question("exact", (PY, "benchmarks/exact_step.py", "--mlp-batches", "1024",
                       "--slices", "8", "--rounds", "3", "--steps", "2", "--warmup", "1",
                       "--json", "{out}/exact_step.json"), 3, parse_exact),
    Question("checkpoint", (PY, "benchmarks/checkpoint_dcp.py", "--repeats", "4",
                            "--json", "{out}/checkpoint.json"), 1, parse_checkpoint),
    Question("zero", (PY, "benchmarks/zero.py", "--variants", "dp_none,dp_optimizer,"
                      "dp_gradients,dp_parameters,torch_ddp,torch_zero", "--repeats", "1",
                      "--steps", "4", "--warmup", "1", "--json", "{out}/zero.json"),
             3, parse_zero),
    Question("elastic", (PY, "benchmarks/elastic.py", "--scenarios", "shrink-kill",
                         "--repeats", "3"), 1, parse_elastic),
    Question("frameworks", (PY, "benchmarks/frameworks.py", "--repeats", "1",
                            "--all-reduce-calls", "50"), 3, parse_frameworks),
    # DeepSpeed is no dependency: PEER stands for a Python that has it (--peer-python)
    Question("peer", (PEER, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                      "2", PEER_BENCH, "float32"), 3, parse_peer,
             env=(("LOCAL_SIZE", "2"), ("DS_ACCELERATOR", "cpu"))),
    Question("chaos", (PY, "benchmarks/chaos.py", "--runs", "1"), 1, parse_chaos),
)


# ------------------------------------------------------------------- running
def shown(argv: tuple[str, ...]) -> str:
    """The command as a reader types it from the repository root."""
    return shlex.join("python" if a == PY else "PEER_PYTHON" if a == PEER else
                      a.replace("{out}", "OUT") for a in argv)


def utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def run_question(q: Question, echo=print, peer: str | None = None) -> dict:
    runs: list[Figures] = []
    load = [os.getloadavg()[0]]
    started, began = utc(), time.monotonic()
    for i in range(q.runs):
        with tempfile.TemporaryDirectory(prefix=f"ddpkit-results-{q.key}-") as scratch:
            argv = [peer if a == PEER else a.replace("{out}", scratch) for a in q.argv]
            echo(f"[{q.key} {i + 1}/{q.runs}] {shown(q.argv)}")
            proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", **dict(q.env)})
            # the chaos run exits 1 when a scenario was not as required: still a result
            if proc.returncode != 0 and not (q.key == "chaos" and proc.returncode == 1):
                raise RuntimeError(f"[{q.key}] exit {proc.returncode}: {shown(q.argv)}\n"
                                   f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            runs += q.parse(proc.stdout, scratch)
        load.append(os.getloadavg()[0])
    env = " ".join(f"{k}={v}" for k, v in q.env)
    return {"command": f"{env} {shown(q.argv)}".strip(), "launches": q.runs, "started": started,
            "wall_s": round(time.monotonic() - began, 1), "load": [min(load), max(load)],
            "runs": runs}


def machine() -> dict:
    model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")),
                         "")
    import torch

    return {"cpu": model or platform.processor(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}


def load_data(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    return {"questions": {}}


def save(data: dict, data_path: str, page_path: str) -> None:
    with open(data_path, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    with open(page_path, "w") as fh:
        fh.write(results_page.render(data))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated question keys")
    p.add_argument("--list", action="store_true", help="print the questions and commands")
    p.add_argument("--render", action="store_true", help="only rewrite the page from --data")
    p.add_argument("--data", default=DATA, help="the figures (default: %(default)s)")
    p.add_argument("--page", default=results_page.RESULTS, help="default: %(default)s")
    p.add_argument("--peer-python", default=os.environ.get("DDPKIT_PEER_PYTHON"),
                   help="a Python with DeepSpeed (and torch, ddpkit) for the peer row; "
                        "without it that row keeps its last figures")
    args = p.parse_args(argv)
    chosen = list(QUESTIONS)
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = sorted(set(keys) - {q.key for q in QUESTIONS})
        if unknown:
            p.error(f"--only {','.join(unknown)}: not a question; known: "
                    f"{', '.join(q.key for q in QUESTIONS)}")
        chosen = [q for q in QUESTIONS if q.key in keys]
    if args.list:
        for q in chosen:
            print(f"{q.key} ({q.runs} launch{'es' if q.runs > 1 else ''}): {shown(q.argv)}")
        return 0
    data = load_data(args.data)
    if args.render:
        save(data, args.data, args.page)
        return 0
    data["machine"] = machine()
    began = time.monotonic()
    failed = []
    if not args.peer_python:
        chosen = [q for q in chosen if q.key != "peer"]
        print("run_all: no --peer-python: the DeepSpeed row keeps its last figures",
              file=sys.stderr)
    for q in chosen:  # saved after each question: a failure keeps the others' figures
        try:
            data["questions"][q.key] = run_question(
                q, lambda line: print(line, file=sys.stderr, flush=True), args.peer_python)
        except (RuntimeError, ValueError, KeyError, OSError) as err:
            failed.append(q.key)  # its last figures stay, with their date
            print(f"run_all: {q.key} failed, its figures left as they were: {err}",
                  file=sys.stderr, flush=True)
            continue
        if not args.only:  # a sitting is every question; --only runs keep their own dates
            data["sitting"] = {"started": data["questions"][chosen[0].key]["started"],
                               "finished": utc(), "wall_s": round(time.monotonic() - began)}
        save(data, args.data, args.page)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
