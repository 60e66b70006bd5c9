"""One command for a machine with CUDA devices: ddpkit's CUDA paths checked and measured.

    timeout 480 python benchmarks/gpu_check.py --out gpu_out

Run it from the repository root of a checkout installed as the README says (nothing
else is installed); it takes under 8 minutes on one GPU. Items, each in a process of
its own (its ranks in processes of their own), so that a crash or a hang in one cannot
take the check down: each reports ok, failed with its one-line error, or skipped with
the reason:

* ddp_vs_torch  - DataParallel against torch DDP on NCCL at W=1 (and W=2 with two GPUs):
                  parameters after a few SGD steps on the 8.4M-parameter MLP and a small
                  transformer, bitwise (else the largest difference, and why);
* step_time     - step times of no DDP, DataParallel and torch DDP on the same two models:
                  DataParallel's overhead over no DDP at W=1, beside torch DDP's;
* comm_nccl     - ddpkit.comm's collectives on CUDA tensors through NCCL against
                  torch.distributed's (results bitwise; all_reduce times);
* comm_gloo     - the same through gloo (two ranks; sharing the GPU where there is one);
* main_job_bf16 - ``ddpkit train --precision bf16``: exit code, test accuracy, and that
                  the weights were trained on CUDA;
* zero          - shard="gradients" and shard="parameters" bitwise against "none", at
                  W=1 on NCCL and at W=2 (NCCL on two GPUs; on one, gloo sharing it);
* exact         - exact mode at V=W and V=8 (W=2, placed as for zero): W ranks end with
                  one process's bits, dropout included; its step time against the
                  default mode's at W=1 (and W=2 on NCCL);
* exact_sum     - exact mode's int32 sum passes on CUDA tensors, compiled by torch.compile
                  (Triton) against the eager functions, bitwise (awkward terms: signed
                  zeros, subnormals, inf, NaN, rounding ties; and 8.4M random ones); the
                  first call's time (the compile) and the steady times of both.

The bitwise runs use torch's deterministic algorithms, and repeat their reference once:
a difference that the repeated reference shows too is the kernels' (the "why"), not
the engines'.

Every item has a time budget and a hard time limit; no item starts when the run's
budget (``--budget``) has less time left than the item's. Writes OUT/gpu_check.json,
OUT/gpu_check.md (the table) and OUT/logs/<item>.log, rewritten after every item.
Exit code: 0 when no item failed, 1 when one did, 2 when there is no CUDA device (run
with ``--dry-run`` or ``--rehearse-on-cpu`` there).

``--dry-run`` runs nothing: every item is reported skipped ("no CUDA device" here).
``--rehearse-on-cpu`` (a developer option, so that the script cannot rot on CPU-only
machines) runs every item's code at tiny sizes on the CPU, with gloo in place of NCCL
and CUDA hidden; bf16 autocast runs on the CPU. Its figures are not GPU results, and
what only a GPU shows it cannot: NCCL itself, gloo moving CUDA tensors, CUDA's random
generators under exact mode, cuBLAS's determinism, ddpkit's buffers placed on the
module's device, and ranks forked from the fork server initializing CUDA.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_BUDGET_S = 450.0
_WRITE_MARGIN_S = 8.0  # an item stops this long before its hard limit, to write its result


class Stopped(Exception):
    """SIGTERM (an outer ``timeout``) or Ctrl-C: the check ends, its files written."""


def _stop(signum, frame) -> None:
    raise Stopped(f"the check was stopped by signal {signum} during this item")


@dataclass(frozen=True)
class Item:
    name: str
    title: str
    budget_s: float  # what it is expected to take on one GPU; not started with less left
    timeout_s: float  # killed after this long


ITEMS = (
    Item("ddp_vs_torch", "DataParallel vs torch DDP: parameters after SGD steps", 45, 120),
    Item("step_time", "step time: no DDP, DataParallel, torch DDP", 60, 150),
    Item("comm_nccl", "ddpkit.comm vs torch.distributed on CUDA tensors, NCCL", 40, 120),
    Item("comm_gloo", "ddpkit.comm vs torch.distributed on CUDA tensors, gloo", 45, 120),
    Item("main_job_bf16", "ddpkit train --precision bf16 end to end", 90, 180),
    Item("zero", "shard='gradients'/'parameters' vs 'none', bitwise", 50, 120),
    Item("exact", "exact mode: W ranks vs 1 process at V=W and V=8; step time", 60, 150),
    Item("exact_sum", "exact mode's int32 sum: compiled (Triton) vs eager, bitwise; time", 40,
         120),
)


def environment() -> dict:
    """Date, machine, devices and versions."""
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    env = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "host": platform.node(), "python": platform.python_version(),
           "cpus": os.cpu_count(), "torch": torch.__version__,
           "cuda_build": torch.version.cuda, "cuda_available": cuda,
           "gpus": torch.cuda.device_count() if cuda else 0, "devices": [],
           "nccl": None, "cudnn": None, "ddpkit": _version("ddpkit"), "commit": _commit()}
    if cuda:
        for i in range(env["gpus"]):
            props = torch.cuda.get_device_properties(i)
            env["devices"].append({"index": i, "name": props.name,
                                   "capability": f"{props.major}.{props.minor}",
                                   "memory_gib": round(props.total_memory / 2**30, 1)})
        try:
            version = torch.cuda.nccl.version()  # a tuple; an int in older releases
            env["nccl"] = (".".join(map(str, version)) if isinstance(version, tuple)
                           else str(version))
        except Exception as exc:  # a torch built without NCCL: recorded, not fatal
            env["nccl"] = f"unavailable ({type(exc).__name__})"
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+changes" if dirty.strip() else "")) if head else None


def run_item(item: Item, mode: str, gpus: int, limit_s: float, out: Path) -> dict:
    """The item in its own session (it and every process it starts killed together at
    ``limit_s``); its result file, or what its death says."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result_file = logs / f"{item.name}.result.json"
    result_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if mode == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal runs on the CPU even beside a GPU
    command = [sys.executable, str(HERE / "gpu_check_items.py"), "--item", item.name,
               "--mode", mode, "--gpus", str(gpus),
               "--seconds", f"{max(limit_s - _WRITE_MARGIN_S, 5.0):.0f}",
               "--result", str(result_file)]
    with open(logs / f"{item.name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            return {"status": "failed",
                    "error": f"killed at its hard time limit of {limit_s:.0f} s"}
        finally:  # also when this process is stopped: nothing of the item outlives it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if result_file.exists():
        return json.loads(result_file.read_text())
    return {"status": "failed",
            "error": f"exited with code {code} without a result; its log ends: "
                     f"{_last_line(logs / f'{item.name}.log')}"}


def _last_line(path: Path) -> str:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1][:300] if lines else "(empty)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--out", required=True, help="directory for gpu_check.json, .md, logs/")
    runs = p.add_mutually_exclusive_group()
    runs.add_argument("--dry-run", action="store_true",
                      help="run nothing: report every item skipped (default: off)")
    runs.add_argument("--rehearse-on-cpu", action="store_true",
                      help="developer option: every item at tiny sizes on the CPU, gloo in "
                           "place of NCCL (default: off)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for the whole run (default: {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--only", default=None, metavar="NAME,NAME",
                   help="run these items only (default: all: "
                        f"{', '.join(i.name for i in ITEMS)})")
    args = p.parse_args(argv)
    plan = list(ITEMS)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {i.name for i in ITEMS})
        if unknown:
            p.error(f"--only: unknown item(s) {', '.join(unknown)}")
        plan = [i for i in ITEMS if i.name in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = environment()
    mode = "cpu" if args.rehearse_on_cpu else "cuda"
    report = {"check": "benchmarks/gpu_check.py", "command": " ".join(sys.argv),
              "mode": "cpu rehearsal" if args.rehearse_on_cpu else
              "dry run" if args.dry_run else "cuda",
              "budget_s": args.budget, "environment": env, "items": []}
    no_device = mode == "cuda" and not env["cuda_available"]
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        run_plan(plan, report, args, mode, no_device, started, out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = any(e["status"] == "failed" for e in report["items"])
    code = 2 if no_device and not args.dry_run else 1 if failed else 0
    report["exit_code"] = code
    write_outputs(report, out)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    if code == 2:
        print("gpu_check: no CUDA device here, nothing was checked; --dry-run checks the "
              "script, --rehearse-on-cpu runs its items on the CPU", file=sys.stderr)
    return code


def run_plan(plan: list[Item], report: dict, args, mode: str, no_device: bool,
             started: float, out: Path) -> None:
    """Each item in turn (or its reason to be skipped), the files rewritten after each."""
    env = report["environment"]
    stopped = None
    for item in plan:
        entry = {"name": item.name, "title": item.title, "budget_s": item.budget_s,
                 "timeout_s": item.timeout_s}
        used = time.monotonic() - started
        if stopped:
            entry.update(status="skipped", reason=stopped)
        elif no_device:
            entry.update(status="skipped", reason="no CUDA device")
        elif args.dry_run:
            entry.update(status="skipped", reason="dry run")
        elif args.budget - used < item.budget_s:
            entry.update(status="skipped",
                         reason=f"the run's budget is nearly spent ({used:.0f} of "
                                f"{args.budget:.0f} s used; this item needs ~{item.budget_s:.0f})")
        else:
            print(f"[{used:5.0f} s] {item.name}: {item.title} ...", flush=True)
            limit = min(item.timeout_s, args.budget - used)
            item_started = time.monotonic()
            try:
                entry.update(run_item(item, mode, env["gpus"], limit, out))
            except (Stopped, KeyboardInterrupt) as exc:
                stopped = "the check was stopped before this item"
                entry.update(status="failed", error=str(exc) or "stopped by Ctrl-C")
            entry["seconds"] = round(time.monotonic() - item_started, 1)
            entry["log"] = f"logs/{item.name}.log"
        print(f"          {item.name}: {status_text(entry)}", flush=True)
        report["items"].append(entry)
        report["seconds"] = round(time.monotonic() - started, 1)
        write_outputs(report, out)


def status_text(entry: dict) -> str:
    if entry["status"] == "failed":
        return f"failed: {entry.get('error')}"
    if entry["status"] == "skipped":
        return f"skipped: {entry.get('reason')}"
    return "ok"


def write_outputs(report: dict, out: Path) -> None:
    from ddpkit.files.durable import write_atomic
    from ddpkit.files.jsonfiles import json_safe

    write_atomic(out / "gpu_check.json", json.dumps(json_safe(report), indent=1))
    write_atomic(out / "gpu_check.md", markdown(report))


def _table(columns: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """A markdown table after a blank line; nothing without rows."""
    if not rows:
        return []
    return ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)]


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _number(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def markdown(report: dict) -> str:
    env = report["environment"]
    devices = ", ".join(f"{d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)"
                        for d in env["devices"]) or "no CUDA device"
    lines = [f"# ddpkit GPU check: {report['mode']}", "",
             f"{env['date_utc']}; {devices}; torch {env['torch']} (CUDA {env['cuda_build']}, "
             f"NCCL {env['nccl']}, cuDNN {env['cudnn']}); ddpkit {env['ddpkit']} (commit "
             f"{env['commit']}); Python {env['python']}, {env['cpus']} CPUs; "
             f"{report.get('seconds', 0):.0f} s, exit code {report.get('exit_code', '-')}; "
             f"`{report['command']}`"]
    items = report["items"]
    lines += _table(("item", "what", "status", "seconds"),
                    [(e["name"], e["title"], status_text(e), e.get("seconds", "-"))
                     for e in items])
    lines += _table(("item", "compared", "layout", "max abs diff", "bitwise", "why"),
                    [(e["name"], c["what"], c["layout"], _number(c["max_abs_diff"]),
                      "yes" if c["bitwise"] else "no", c.get("why", ""))
                     for e in items for c in e.get("comparisons", [])])
    lines += _table(("item", "timed", "layout", "variant", "median ms", "x baseline"),
                    [(e["name"], t["what"], t["layout"], t["variant"],
                      _number(t["median_ms"]), f"{_number(t['ratio'])} ({t['baseline']})")
                     for e in items for t in e.get("timings", [])])
    facts = [f"- {e['name']}: {k}: {_cell(v)}" for e in items
             for k, v in e.get("facts", {}).items()]
    lines += [""] + facts if facts else []
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
