"""The GPU check's items, and the entry that runs one of them in its own process.

    python benchmarks/gpu_check_items.py --item NAME --mode cuda|cpu --gpus N \\
        --seconds S --result FILE

(benchmarks/gpu_check.py starts it; it is not meant to be run by hand.) The item runs
within S seconds and writes FILE: its status (ok, or failed with one line), comparisons,
timings and facts. Here: ddpkit.comm against torch.distributed, and the main job end to
end; the training items are in gpu_check_training.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.comm.auto import algo_for
from ddpkit.files.durable import write_atomic
from ddpkit.files.jsonfiles import json_safe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_exact_sum import exact_sum  # noqa: E402
from gpu_check_lib import (  # noqa: E402
    CheckFailed,
    Layout,
    Report,
    Setup,
    difference,
    interleaved,
    one_line,
)
from gpu_check_training import ddp_vs_torch, exact, step_time, zero  # noqa: E402

# ------------------------------------------------- ddpkit.comm against torch.distributed

ALGOS = ("auto", "backend")
DTYPES = (torch.float32, torch.bfloat16, torch.int32)
CORRECTNESS_SIZES = (1, 4099)  # elements per rank: one, and an odd count


def _input(rank: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + n)
    t = (torch.randn(n, generator=g) if dtype.is_floating_point
         else torch.randint(-1000, 1000, (n,), generator=g))
    return t.to(dtype).to(device)


def _cases(world: ddpkit.World, n: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Per collective: (ddpkit's call, torch's call, the result as computed locally from
    every rank's input), each a function of a fresh copy of this rank's input."""
    W, r = world.world_size, world.rank
    every = [_input(q, n, dtype, device) for q in range(W)]
    wide = [_input(q + W, n * W, dtype, device) for q in range(W)]
    total = torch.stack(every).sum(0).to(dtype)
    src, dst = W - 1, 0
    cases = {
        "all_reduce sum": (lambda t, a: ddpkit.comm.all_reduce(t, "sum", algo=a),
                           lambda t: dist.all_reduce(t), total, every[r]),
        "all_reduce max": (lambda t, a: ddpkit.comm.all_reduce(t, "max", algo=a),
                           lambda t: dist.all_reduce(t, dist.ReduceOp.MAX),
                           torch.stack(every).amax(0), every[r]),
        "broadcast": (lambda t, a: ddpkit.comm.broadcast(t, src, algo=a),
                      lambda t: dist.broadcast(t, src), every[src], every[r]),
    }
    if dtype.is_floating_point:  # ddpkit's avg is the sum divided by the group size
        cases["all_reduce avg"] = (lambda t, a: ddpkit.comm.all_reduce(t, "avg", algo=a),
                                   lambda t: (dist.all_reduce(t), t.div_(W)),
                                   total.div(W), every[r])
    cases["reduce_scatter sum"] = (
        lambda t, a: _into(t, n, lambda out: ddpkit.comm.reduce_scatter(out, t, algo=a)),
        lambda t: _into(t, n, lambda out: dist.reduce_scatter_tensor(out, t)),
        torch.stack(wide).sum(0).to(dtype)[r * n:(r + 1) * n], wide[r])
    cases["all_gather"] = (
        lambda t, a: _into(t, n * W, lambda out: ddpkit.comm.all_gather(out, t, algo=a)),
        lambda t: _into(t, n * W, lambda out: dist.all_gather_into_tensor(out, t)),
        torch.cat(every), every[r])
    if r == dst:  # only the destination's result is defined
        cases["reduce sum"] = (lambda t, a: ddpkit.comm.reduce(t, dst, algo=a),
                               lambda t: dist.reduce(t, dst), total, every[r])
    else:
        cases["reduce sum"] = (lambda t, a: ddpkit.comm.reduce(t, dst, algo=a),
                               lambda t: dist.reduce(t, dst), None, every[r])
    return cases


def _into(source: torch.Tensor, numel: int, call: Callable) -> torch.Tensor:
    out = torch.empty(numel, dtype=source.dtype, device=source.device)
    call(out)
    return out


def _attempt(call: Callable, *args) -> tuple[object, str | None]:
    try:
        return call(*args), None
    except Exception as exc:  # recorded: the item compares ddpkit's behaviour with torch's
        return None, one_line(exc)


def comm_rank(world: ddpkit.World, setup: Setup) -> dict:
    device = torch.device(world.device)
    rows = []
    for algo in ALGOS:
        for dtype in DTYPES:
            for n in CORRECTNESS_SIZES:
                for name, (ours_fn, torch_fn, local, given) in _cases(world, n, dtype,
                                                                      device).items():
                    ours, ours_error = _attempt(_result, ours_fn, given, algo)
                    ref, torch_error = _attempt(_result, torch_fn, given, None)
                    if local is None:  # not the destination of a reduce: nothing defined
                        ours = ref = None
                    elif torch_error:
                        ref = local.cpu()
                    rows.append({"case": f"{name} {str(dtype).removeprefix('torch.')} n={n}",
                                 "algo": algo, "ours": ours, "reference": ref,
                                 "ours_error": ours_error, "torch_error": torch_error})
        _, barrier_error = _attempt(functools.partial(ddpkit.comm.barrier, algo=algo))
        rows.append({"case": "barrier", "algo": algo, "ours": None, "reference": None,
                     "ours_error": barrier_error, "torch_error": None})
    return {"rows": rows, "auto": algo_for(None, device), "times": _comm_times(setup, device)}


def _result(call: Callable, given: torch.Tensor, algo: str | None) -> torch.Tensor:
    t = given.clone()
    out = call(t) if algo is None else call(t, algo)
    result = out if isinstance(out, torch.Tensor) else t
    if result.device != given.device:
        raise CheckFailed(f"the result is on {result.device}, the input on {given.device}")
    return result.cpu()


def _comm_times(setup: Setup, device: torch.device) -> dict:
    times = {}
    for n in setup.size((1024, 256 * 1024, 16 * 1024 * 1024), (256, 16 * 1024)):
        t = torch.zeros(n, device=device)
        size = f"{4 * n // 2**20} MiB" if 4 * n >= 2**20 else f"{4 * n // 1024} KiB"
        times[size] = interleaved(
            {"ddpkit.comm.all_reduce": lambda t=t: ddpkit.comm.all_reduce(t),
             # without the agreement check's all-gather: what the check itself costs
             "ddpkit.comm.all_reduce check=False":
                 lambda t=t: ddpkit.comm.all_reduce(t, check=False),
             "torch all_reduce": lambda t=t: dist.all_reduce(t)},
            device, rounds=setup.size(5, 2), repeats=setup.size(10, 2), warmup=2)
    return times


def _comm(layout: Layout, setup: Setup, report: Report, seconds_left) -> None:
    results = report.run(comm_rank, layout, (setup,), seconds_left)
    for algo in ALGOS:
        ours, refs, differing = [], [], []
        for rank, result in enumerate(results):
            for row in (x for x in result["rows"] if x["algo"] == algo):
                label = f"{row['case']} algo={algo}, rank {rank}"
                if row["ours_error"] and not row["torch_error"]:
                    report.failures.append(f"{label}: ddpkit raised ({row['ours_error']}) "
                                           "where torch did not")
                elif row["torch_error"]:
                    ours_said = row["ours_error"] or "compared with the result computed locally"
                    report.facts[f"torch refused {row['case']}"] = (
                        f"{row['torch_error']}; ddpkit: {ours_said}")
                if row["ours"] is not None and row["reference"] is not None:
                    ours.append(row["ours"])
                    refs.append(row["reference"])
                    if not torch.equal(row["ours"], row["reference"]):
                        differing.append(label)
        report.compare(f"ddpkit.comm (algo={algo!r}) vs torch.distributed: "
                       f"{len(refs)} results of 7 collectives x {len(DTYPES)} dtypes x "
                       f"{len(CORRECTNESS_SIZES)} sizes, every rank", layout,
                       difference(ours, refs))
        if differing:
            report.comparisons[-1]["differing"] = differing[:20]
    report.facts[f"algo='auto' on {layout.devices[0].split(':')[0]} tensors"] = \
        results[0]["auto"]
    for size, times in results[0]["times"].items():
        report.timing(f"all_reduce float32 {size}", layout, times, baseline="torch all_reduce")


def comm_nccl(setup: Setup, report: Report, seconds_left) -> None:
    _comm(setup.layout(min(setup.gpus, 2) if setup.cuda else 2), setup, report, seconds_left)


def comm_gloo(setup: Setup, report: Report, seconds_left) -> None:
    _comm(Layout("gloo", setup.pair_layout().devices), setup, report, seconds_left)


# ------------------------------------------------- the main job end to end


def main_job_bf16(setup: Setup, report: Report, seconds_left) -> None:
    """``ddpkit train --precision bf16`` as a user runs it (CPU rehearsal: 1 epoch, one
    process, bf16 autocast on the CPU)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-train-") as out:
        command = [sys.executable, "-m", "ddpkit.cli", "train", "--precision", "bf16",
                   "--out-dir", out, "--no-progress"]
        if not setup.cuda:
            command += ["--epochs", "1", "--nproc-per-node", "1"]
        report.facts["command"] = " ".join(["ddpkit", *command[3:]]).replace(out, "OUT")
        started = time.perf_counter()
        try:
            code = subprocess.run(command, timeout=seconds_left(), check=False).returncode
        except subprocess.TimeoutExpired as exc:
            raise CheckFailed(f"ddpkit train did not finish within {exc.timeout:.0f} s") from None
        report.facts["wall_s"] = round(time.perf_counter() - started, 1)
        report.facts["exit_code"] = code
        report.require(code == 0, f"ddpkit train exited with {code}")
        runs = sorted(Path(out).glob("*/summary.json"))
        if not runs:
            raise CheckFailed(f"ddpkit train (exit {code}) wrote no summary.json")
        summary = json.loads(runs[-1].read_text())
        for key in ("final_test_acc", "best_test_acc", "epochs", "world_size", "train_time_s"):
            report.facts[key] = summary.get(key)
        places = _saved_devices(runs[-1].parent / "model.pt")
        report.facts["weights saved from"] = sorted(places)
        want = "cuda" if setup.cuda else "cpu"
        report.require(all(p.startswith(want) for p in places),
                       f"the weights were trained on {sorted(places)}, not {want}")
        floor = 0.9 if setup.cuda else 0.3  # 20 epochs reach ~0.98 in fp32; 1 epoch less
        accuracy = summary.get("final_test_acc") or 0.0
        report.require(accuracy >= floor, f"test accuracy {accuracy:.4f} below {floor}")


def _saved_devices(path: Path) -> set[str]:
    """The devices the saved tensors were on (torch.save records each storage's)."""
    places: set[str] = set()

    def note(storage, location):
        places.add(location)
        return storage

    torch.load(path, map_location=note, weights_only=True)
    return places


ITEMS: dict[str, Callable[[Setup, Report, Callable[[], float]], None]] = {
    "ddp_vs_torch": ddp_vs_torch,
    "step_time": step_time,
    "comm_nccl": comm_nccl,
    "comm_gloo": comm_gloo,
    "main_job_bf16": main_job_bf16,
    "zero": zero,
    "exact": exact,
    "exact_sum": exact_sum,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--item", required=True, choices=sorted(ITEMS))
    p.add_argument("--mode", required=True, choices=["cuda", "cpu"])
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--seconds", type=float, required=True, help="time this item may take")
    p.add_argument("--result", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.seconds
    setup = Setup(cuda=args.mode == "cuda", gpus=args.gpus)
    report = Report()
    error = None
    try:
        ITEMS[args.item](setup, report, lambda: max(deadline - time.monotonic(), 1.0))
    except Exception as exc:  # the item's one line; the traceback goes to its log
        traceback.print_exc()
        error = one_line(exc)
    failures = ([error] if error else []) + report.failures
    result = {"status": "failed" if failures else "ok",
              "error": "; ".join(failures)[:600] if failures else None,
              "failures": failures, "comparisons": report.comparisons,
              "timings": report.timings, "facts": report.facts}
    write_atomic(args.result, json.dumps(json_safe(result), indent=1, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
