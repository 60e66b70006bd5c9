"""What torch DDP itself costs per step on one rank: per gradient tensor and per byte.

    .venv/bin/python benchmarks/ddp_overhead.py [--rounds 15] [--json out.json]

``ddpkit plan project`` adds this to the user's measured single-device step
(``--step-ms``): DDP's autograd hook, the copy of each gradient into its bucket, the
scaling by 1/W and the copy back out run on every step, even on one GPU. They are
measured here on a process group of one (gloo, one thread), so no communication is
mixed in, by timing the same model with and without
``torch.nn.parallel.DistributedDataParallel``:

* per tensor: K small ``nn.Linear`` weights (64 floats each) for several K; the slope
  of the extra time over K is the fixed cost of one gradient tensor (hook, dispatch of
  its copies), which does not depend on its size;
* per byte: a few large weights for several total sizes; the slope of the extra time
  over the gradient bytes, divided by the time this machine takes to copy one byte
  (``dst.copy_(src)`` of the same sizes, timed beside it), is the number of passes over
  the gradients' memory DDP adds (read and write count one each).

Models run interleaved, round by round, in a fresh random order, and every figure is a
median, so background load hits them alike. The two slopes come from a least-squares
line through the medians. Prints the points and the fit; with --json, writes both.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

SMALL = 8  # features of the small layers: 64 floats per weight, whose copy costs nothing
TENSOR_COUNTS = (32, 128, 512)
LARGE_MIB = (4, 16, 64)  # total gradient MiB of the large-tensor models (4 weights each)


def small_model(count: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(SMALL, SMALL, bias=False) for _ in range(count)])


def large_model(mib: int) -> nn.Module:
    # Four square weights of mib/4 MiB each; the batch is tiny so compute stays small.
    side = int((mib * 2**20 / 4 / 4) ** 0.5)
    return nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(4)])


def step_time(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    """Median seconds of zero_grad + forward + backward (no optimizer: DDP does not
    change it)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_time(nbytes: int, steps: int) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def measure(rounds: int, steps: int) -> dict:
    cases = {}
    for count in TENSOR_COUNTS:
        cases[f"tensors={count}"] = (small_model(count), torch.randn(2, SMALL), count, 0)
    for mib in LARGE_MIB:
        model = large_model(mib)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        side = model[0].in_features
        cases[f"bytes={mib}MiB"] = (model, torch.randn(1, side), 4, nbytes)
    wrapped = {name: (model, nn.parallel.DistributedDataParallel(copy.deepcopy(model)))
               for name, (model, *_rest) in cases.items()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    copies: dict[int, list[float]] = {nbytes: [] for *_x, nbytes in cases.values() if nbytes}
    order = list(cases)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            _model, x, _count, nbytes = cases[name]
            plain, ddp = wrapped[name]
            samples[name].append((step_time(plain, x, steps), step_time(ddp, x, steps)))
            if nbytes:
                copies[nbytes].append(copy_time(nbytes, steps))
    points = {}
    for name, (_m, _x, count, nbytes) in cases.items():
        extra = statistics.median(d - p for p, d in samples[name])
        points[name] = {"tensors": count, "bytes": nbytes, "extra_s": extra,
                        "plain_s": statistics.median(p for p, _ in samples[name])}
    small = [points[f"tensors={k}"] for k in TENSOR_COUNTS]
    per_tensor, _ = fit_line([p["tensors"] for p in small], [p["extra_s"] for p in small])
    large = [points[f"bytes={m}MiB"] for m in LARGE_MIB]
    # The large models have 4 tensors each: take their fixed cost out before the slope.
    per_byte, _ = fit_line([p["bytes"] for p in large],
                           [p["extra_s"] - 4 * per_tensor for p in large])
    copy_per_byte, _ = fit_line(list(copies), [statistics.median(v) for v in copies.values()])
    return {"points": points, "per_tensor_s": per_tensor, "per_byte_s": per_byte,
            "copy_per_byte_s": copy_per_byte, "passes": per_byte / copy_per_byte * 2,
            "torch": torch.__version__, "rounds": rounds, "steps": steps,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: 15)")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps per model per round (default: 5)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        result = measure(args.rounds, args.steps)
    finally:
        dist.destroy_process_group()
    print(f"# torch {result['torch']} DDP on one gloo rank, 1 thread, {result['date']}, "
          f"{args.rounds} rounds x {args.steps} steps (medians)")
    print(f"# {'model':<14} {'tensors':>7} {'MiB':>6} {'step':>10} {'DDP extra':>10}")
    for name, pt in result["points"].items():
        print(f"  {name:<14} {pt['tensors']:>7} {pt['bytes'] / 2**20:>6.1f} "
              f"{pt['plain_s'] * 1e3:>8.2f}ms {pt['extra_s'] * 1e3:>8.3f}ms")
    print(f"per tensor: {result['per_tensor_s'] * 1e6:.1f} us; per byte: "
          f"{result['per_byte_s'] * 1e12:.1f} ps = {result['passes']:.1f} memory passes "
          f"(a copy here: {result['copy_per_byte_s'] * 1e12:.1f} ps/B = 2 passes)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
