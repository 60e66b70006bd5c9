"""One training step of an 8.4M-parameter MLP: single process vs torch DDP vs naive vs ddpkit.

All variants run side by side in the same two processes (gloo, one thread per rank),
interleaved round by round so machine noise hits them alike:

* single  - rank 0 trains alone (no communication) while the other ranks wait;
* local   - every rank trains its own copy at the same time, no communication: the
            compute-only ceiling of scaling efficiency on this machine (opt-in);
* torch   - torch.nn.parallel.DistributedDataParallel (defaults);
* naive   - the tutorial's average_gradients(): one blocking all_reduce per parameter
            after backward, then divide;
* ddpkit  - ddpkit.DataParallel (optionally with --hook: allreduce, ring, fp16_compress,
            bf16_compress, shm).

Reported: median step time (zero_grad + forward + backward + SGD step) on rank 0, the
ratio to torch DDP, scaling efficiency = W-rank throughput / (W x one-rank throughput)
= t_single / t_variant, and whether parameters after the same steps are bit-identical
to torch DDP's (and across ranks).

Run:  python benchmarks/ddp_step.py [--rounds 5 --steps 6 --hook shm --json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpkit

SIZES = (1024, 2048, 2048, 1024, 10)


def make_mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def naive_average_gradients(model: nn.Module) -> None:
    """Seed 000's average_gradients: one all_reduce per parameter, then divide."""
    size = float(dist.get_world_size())
    for p in model.parameters():
        dist.all_reduce(p.grad.data, op=dist.ReduceOp.SUM)
        p.grad.data /= size


def ddpkit_options(hook: str | None) -> dict:
    if hook is None:
        return {}
    if hook == "shm":
        from ddpkit.comm.shm.hook import ShmState, shm_hook

        return {"comm_hook": shm_hook, "comm_state": ShmState()}
    from ddpkit.parallel.hooks import HOOKS

    return {"comm_hook": HOOKS[hook]}


def worker(world: ddpkit.World, opts: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = make_mlp()
    W, rank = world.world_size, world.rank
    g = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(opts["batch"], SIZES[0], generator=g),
                torch.randint(0, SIZES[-1], (opts["batch"],), generator=g)) for _ in range(4)]

    cap = opts["bucket_cap_mb"]
    models = {
        "single": copy.deepcopy(base),
        "local": copy.deepcopy(base),
        "torch": ddpkit.parallel.data_parallel(copy.deepcopy(base), engine="torch",
                                               bucket_cap_mb=cap),
        "naive": copy.deepcopy(base),
        "ddpkit": ddpkit.parallel.data_parallel(copy.deepcopy(base), engine="ddpkit",
                                                bucket_cap_mb=cap or 25.0,
                                                **ddpkit_options(opts["hook"])),
    }
    names = [n for n in opts["variants"] if n in models]
    optimizers = {n: torch.optim.SGD(models[n].parameters(), lr=0.01) for n in names}
    steps_done = dict.fromkeys(names, 0)
    times: dict[str, list[float]] = {n: [] for n in names}

    def step(name: str) -> float:
        model, opt = models[name], optimizers[name]
        x, y = batches[steps_done[name] % len(batches)]
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if name == "naive":
            naive_average_gradients(model)
        opt.step()
        elapsed = time.perf_counter() - start
        steps_done[name] += 1
        return elapsed

    for round_index in range(opts["rounds"]):
        for name in names:
            dist.barrier()
            n = opts["steps"] + (opts["warmup"] if round_index == 0 else 0)
            if name == "single" and rank != 0:
                dist.barrier()  # wait quietly while rank 0 runs alone
                continue
            for i in range(n):
                t = step(name)
                if round_index > 0 or i >= opts["warmup"]:
                    times[name].append(t)
            if name == "single":
                dist.barrier()
        if rank == 0:
            print(f"  round {round_index + 1}/{opts['rounds']} done", file=sys.stderr, flush=True)

    def params(name):
        model = models[name]
        inner = model.module if hasattr(model, "module") else model
        return [p.detach() for p in inner.parameters()]

    equal_to_torch = {n: all(torch.equal(a, b) for a, b in zip(params(n), params("torch")))
                      for n in names if n not in ("single", "local") and "torch" in names}
    checksums = {n: float(sum(p.double().sum() for p in params(n))) for n in names
                 if n not in ("single", "local")}
    gathered: list = [None] * W
    dist.all_gather_object(gathered, checksums)
    replicas_equal = {n: len({c[n] for c in gathered}) == 1 for n in checksums}
    return {"times": times, "equal_to_torch": equal_to_torch, "replicas_equal": replicas_equal,
            "steps_done": steps_done}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket cap for torch DDP and ddpkit (default: each engine's 25 MiB)")
    p.add_argument("--hook", default=None,
                   choices=["allreduce", "ring", "fp16_compress", "bf16_compress", "shm"],
                   help="comm hook for the ddpkit variant")
    p.add_argument("--variants", default="single,torch,naive,ddpkit")
    p.add_argument("--json", default=os.path.join("benchmarks", "results", "ddp_step.json"))
    args = p.parse_args(argv)
    opts = {"batch": args.batch, "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "bucket_cap_mb": args.bucket_cap_mb, "hook": args.hook,
            "variants": args.variants.split(",")}
    n_params = sum(p.numel() for p in make_mlp().parameters())
    print(f"ddp_step: MLP {'-'.join(map(str, SIZES))} ({n_params / 1e6:.1f}M params), "
          f"batch {args.batch}/rank, {args.world_size} ranks gloo, 1 thread/rank, "
          f"hook={args.hook or 'none'}", file=sys.stderr)
    results = ddpkit.spawn(worker, nprocs=args.world_size, args=(opts,))
    r0 = results[0]
    medians = {n: statistics.median(ts) * 1e3 for n, ts in r0["times"].items() if ts}
    torch_ms = medians.get("torch")
    single_ms = medians.get("single")
    rows = []
    print(f"\n{'variant':8} {'median ms':>10} {'vs torch':>9} {'scaling eff':>12} "
          f"{'== torch params':>16} {'replicas equal':>15}")
    for name, ms in medians.items():
        row = {"variant": name, "median_ms": round(ms, 2),
               "vs_torch": round(ms / torch_ms, 3) if torch_ms else None,
               "scaling_efficiency": (round(single_ms / ms, 3)
                                      if single_ms and name != "single" else None),
               "bitwise_equal_to_torch": r0["equal_to_torch"].get(name),
               "replicas_equal": all(r["replicas_equal"].get(name, True) for r in results),
               "samples": len(r0["times"][name])}
        rows.append(row)

        def fmt(v, width):
            text = "-" if v is None else str(v) if isinstance(v, bool) else f"{v:.3f}"
            return f"{text:>{width}}"

        print(f"{name:8} {ms:10.1f} {fmt(row['vs_torch'], 9)} "
              f"{fmt(row['scaling_efficiency'], 12)} "
              f"{fmt(row['bitwise_equal_to_torch'], 16)} {fmt(row['replicas_equal'], 15)}")
    report = {"benchmark": "ddp_step", "argv": sys.argv[1:], "model_params": n_params,
              "world_size": args.world_size, "batch_per_rank": args.batch, "hook": args.hook,
              "torch": torch.__version__, "rows": rows, "steps_done": r0["steps_done"]}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
