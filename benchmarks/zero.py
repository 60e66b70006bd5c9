"""Sharded data parallelism (ZeRO) side by side: step time, peak memory, optimizer state.

Variants (each in its own fresh W processes, since peak RSS only grows within a
process; variants interleaved in a fresh random order every repeat):

* dp_none       - ddpkit.DataParallel(model)                      (shard="none")
* dp_optimizer  - ddpkit.DataParallel(model, shard="optimizer")   (ZeRO-1)
* dp_gradients  - ddpkit.DataParallel(model, shard="gradients")   (ZeRO-2)
* dp_parameters - ddpkit.DataParallel(model, shard="parameters")  (ZeRO-3)
* torch_ddp     - torch.nn.parallel.DistributedDataParallel(model)
* torch_zero    - torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)

Every variant trains the same model with AdamW (fp32) on the same batches. Reported per
variant: the median step time (zero_grad + forward + backward + step) over every timed
step of every repeat on rank 0, its ratio to dp_none; per rank the peak RSS growth over
the bare model (VmHWM after the steps minus VmRSS once model and batches exist, with
the peak reset there through /proc/self/clear_refs), and the optimizer-state bytes; next
to them the bytes per parameter the formulas give for everything but the weights:
none 12 (gradients 4 + AdamW 8), optimizer 4 + 8/N, gradients 12/N, parameters 16/N - 4
(the weights themselves are sharded too). The weights (4 bytes per parameter) are in the
bare model; ``--with-weights`` measures from before the model is built instead, against
16, 4 + 4 + 8/N, 4 + 12/N and 16/N. (A model is built whole before DataParallel shards
it, so a rank's peak from before the build is at least the 4 bytes per parameter of the
whole model, whatever the mode.)

Run:  python benchmarks/zero.py [--world-size 2 --model mlp14m --repeats 3 --steps 6]
      python benchmarks/zero.py --model mlp200m --variants dp_none,dp_optimizer,dp_gradients \\
          --with-weights --repeats 1 --steps 2 --batch 8
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.files.durable import write_atomic
from ddpkit.parallel.zero.sharded_state import state_bytes

MODELS = {"mlp14m": (1536, 6), "mlp200m": (5000, 8)}  # (width, Linear layers)
VARIANTS = ("dp_none", "dp_optimizer", "dp_gradients", "dp_parameters", "torch_ddp",
            "torch_zero")
SHARD = {"dp_none": "none", "dp_optimizer": "optimizer", "dp_gradients": "gradients",
         "dp_parameters": "parameters"}


def make_model(name: str) -> nn.Module:
    width, depth = MODELS[name]
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def formula_bytes(variant: str, world: int, with_weights: bool) -> float | None:
    shard = {**SHARD, "torch_ddp": "none", "torch_zero": "optimizer"}[variant]
    extra = {"none": 12.0, "optimizer": 4.0 + 8.0 / world, "gradients": 12.0 / world,
             "parameters": 16.0 / world - 4.0}[shard]
    return extra + (4.0 if with_weights else 0.0)


def variant_list(text: str) -> list[str]:
    names = text.split(",")
    if any(n not in VARIANTS for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: known variants are {', '.join(VARIANTS)}")
    return names


def worker(world: ddpkit.World, variant: str, opts: dict) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    # Code, not training state: torch.optim and DataParallel's first forward import
    # torch._dynamo (~70 MiB of modules); loaded before the baseline in every variant.
    importlib.import_module("torch._dynamo")
    if opts["with_weights"]:
        reset_peak()
        base_kib = rss_kib("VmRSS")
    torch.manual_seed(0)
    model = make_model(opts["model"])
    width = MODELS[opts["model"]][0]
    g = torch.Generator().manual_seed(1 + world.rank)
    batches = [(torch.randn(opts["batch"], width, generator=g),
                torch.randint(0, width, (opts["batch"],), generator=g)) for _ in range(2)]
    if not opts["with_weights"]:
        reset_peak()
        base_kib = rss_kib("VmRSS")
    if variant in SHARD:
        wrapped = ddpkit.DataParallel(model, shard=SHARD[variant])
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    else:
        wrapped = DistributedDataParallel(model)
        if variant == "torch_zero":
            opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-4)
        else:
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    times = []
    for i in range(opts["warmup"] + opts["steps"]):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
        if i >= opts["warmup"]:
            times.append(time.perf_counter() - start)
    peak_kib = rss_kib("VmHWM")
    inner = opt.optim if variant == "torch_zero" else opt
    held = state_bytes(inner)
    if variant in SHARD:
        wrapped.gather_parameters()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"times": times, "growth_bytes": (peak_kib - base_kib) * 1024,
            "state_bytes": held, "checksum": checksum}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", choices=sorted(MODELS), default="mlp14m")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--repeats", type=int, default=3, help="fresh launches per variant")
    p.add_argument("--steps", type=int, default=6, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--with-weights", action="store_true",
                   help="measure growth from before the model is built (weights included)")
    p.add_argument("--variants", type=variant_list, default=list(VARIANTS),
                   help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--json", default=os.path.join("benchmarks", "results", "zero.json"))
    args = p.parse_args(argv)
    variants = args.variants
    opts = {"model": args.model, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup, "with_weights": args.with_weights}
    n_params = sum(q.numel() for q in make_model(args.model).parameters())
    W = args.world_size
    print(f"zero: {args.model} ({n_params / 1e6:.1f}M params), AdamW fp32, batch "
          f"{args.batch}/rank, {W} ranks, 1 thread/rank, {args.repeats} launches x "
          f"{args.steps} steps per variant", file=sys.stderr)
    runs: dict[str, list[list[dict]]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in random.Random(repeat).sample(variants, len(variants)):
            runs[variant].append(ddpkit.spawn(worker, nprocs=W, args=(variant, opts)))
            print(f"  launch {repeat + 1}/{args.repeats}: {variant} done", file=sys.stderr,
                  flush=True)
    rows = []
    base_ms = None
    for variant in variants:
        launches = runs[variant]
        ms = statistics.median(t for launch in launches for t in launch[0]["times"]) * 1e3
        if variant == "dp_none":
            base_ms = ms
        growth = [statistics.median(launch[r]["growth_bytes"] for launch in launches)
                  for r in range(W)]
        state = [launches[0][r]["state_bytes"] for r in range(W)]
        rows.append({
            "variant": variant, "median_ms": round(ms, 2),
            "growth_mib_per_rank": [round(b / 2**20, 1) for b in growth],
            "growth_bytes_per_param": [round(b / n_params, 2) for b in growth],
            "formula_bytes_per_param": round(formula_bytes(variant, W, args.with_weights), 2),
            "state_mib_per_rank": [round(b / 2**20, 1) for b in state],
            "state_bytes_per_param": [round(b / n_params, 2) for b in state],
            "replicas_equal": all(len({launch[r]["checksum"] for r in range(W)}) == 1
                                  for launch in launches),
        })
    by = {r["variant"]: r for r in rows}
    none = by.get("dp_none")
    print(f"\n{'variant':14}{'median ms':>11}{'vs none':>9}{'peak RSS growth MiB/rank':>27}"
          f"{'B/param':>16}{'formula':>9}{'opt state MiB':>16}{'replicas ==':>13}")
    for r in rows:
        vs = r["median_ms"] / base_ms if base_ms else None
        r["vs_none"] = None if vs is None else round(vs, 3)
        print(f"{r['variant']:14}{r['median_ms']:11.1f}{'-' if vs is None else f'{vs:.3f}':>9}"
              f"{str(r['growth_mib_per_rank']):>27}{str(r['growth_bytes_per_param']):>16}"
              f"{r['formula_bytes_per_param']:9.2f}{str(r['state_mib_per_rank']):>16}"
              f"{str(r['replicas_equal']):>13}")
    if none and "dp_gradients" in by:
        grad = by["dp_gradients"]
        def worst(row, key):
            return max(row[key])

        verdict = {
            "state_ratio": round(worst(grad, "state_mib_per_rank")
                                 / worst(none, "state_mib_per_rank"), 3),
            "rss_ratio": round(worst(grad, "growth_mib_per_rank")
                               / worst(none, "growth_mib_per_rank"), 3),
            "time_ratio": grad["vs_none"],
        }
        if "torch_zero" in by:
            tz = by["torch_zero"]
            verdict["time_vs_torch_zero"] = round(grad["median_ms"] / tz["median_ms"], 3)
            verdict["rss_vs_torch_zero"] = round(
                worst(grad, "growth_mib_per_rank") / worst(tz, "growth_mib_per_rank"), 3)
        print("\ngradients vs none: optimizer state x{state_ratio} (target <= 0.55), peak RSS "
              "growth x{rss_ratio} (<= 0.75), step time x{time_ratio} (<= 1.0)".format(**verdict))
        if "time_vs_torch_zero" in verdict:
            print("gradients vs torch DDP + ZeroRedundancyOptimizer: step time "
                  "x{time_vs_torch_zero}, peak RSS growth x{rss_vs_torch_zero} (both < 1)"
                  .format(**verdict))
    else:
        verdict = {}
    if args.json:
        report = {"benchmark": "zero", "argv": sys.argv[1:], "model": args.model,
                  "model_params": n_params, "world_size": W, "batch_per_rank": args.batch,
                  "torch": torch.__version__, "rows": rows, "verdict": verdict,
                  "loadavg": os.getloadavg()}
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        write_atomic(args.json, json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
