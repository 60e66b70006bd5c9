"""One training step of an 8.4M-parameter MLP: torch DDP and its variants vs ddpkit.

All variants run side by side in the same processes (gloo, one thread per rank),
interleaved round by round so machine noise hits them alike; the variants run in a fresh
random order every round (the same on every rank, seeded by the round), so none always
runs first or right after the same other one (a rotation would keep every variant behind
the same predecessor, which leaves its caches and heap in its own state), and every
round trains on freshly generated batches (the same for all variants of the round):

* single    - rank 0 trains alone (no communication) while the other ranks wait;
* local     - every rank trains its own copy at the same time, no communication: the
              compute-only ceiling of scaling efficiency on this machine;
* local_synced - as local, but the ranks meet at ``ddpkit.comm.barrier()`` after backward
              (the wait itself is not timed), so every rank runs its optimizer step at
              the same moment, as under any synchronous data parallelism (opt-in: shows
              what that alignment alone costs when the ranks share memory bandwidth);
* torch     - torch.nn.parallel.DistributedDataParallel(model), defaults;
* torch_gbv - torch DDP with gradient_as_bucket_view=True;
* torch_shm - torch DDP with ddpkit's shared-memory comm hook (ddpkit.comm.shm.shm_hook):
              torch's reducer on ddpkit's transport;
* naive     - the tutorial's average_gradients(): one blocking all_reduce per parameter
              after backward, then divide (opt-in);
* ddpkit    - ddpkit.DataParallel(model), defaults (or --comm / --hook);
* ddpkit_backend - ddpkit.DataParallel(model, comm="backend"): gloo, as torch (opt-in).

Timing-only variants (opt-in; their parameters are NOT synchronized, so they are left
out of the bitwise and replica checks): they take parts of DataParallel(model) away to
show where its time over ``local`` goes.

* ddpkit_nosum  - DataParallel(model) whose buckets are never summed: every gradient is
                  still copied and scaled into its bucket, but no rank waits for or reads
                  another (the cost of the copy alone);
* ddpkit_unarmed - DataParallel(model) whose backward hooks do nothing (the wrapper's
                  own forward, no copy, no sum);
* ddpkit_nocopy - DataParallel(model) whose hooks leave each gradient where autograd put
                  it (no copy into the bucket) while the buckets are summed as usual: the
                  bound on a design in which autograd writes gradients straight into the
                  shared segment.

Reported: median step time (zero_grad + forward + backward + SGD step) on rank 0, the
ratio to torch DDP and to torch_shm, scaling efficiency against one process
(t_single / t_variant) and against the compute-only ceiling (t_local / t_variant), and
whether parameters after the same steps are bit-identical to torch DDP's (and across
ranks), and the median count of minor page faults per step on rank 0 (a variant whose
gradients get fresh memory every step pays for it in faults, not in communication).

Run:  python benchmarks/ddp_step.py [--rounds 9 --steps 6 --comm shm --json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpkit

SIZES = (1024, 2048, 2048, 1024, 10)


def make_mlp(sizes: tuple[int, ...] = SIZES) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def naive_average_gradients(model: nn.Module) -> None:
    """The distributed tutorial's average_gradients: one all_reduce per parameter, then divide."""
    size = float(dist.get_world_size())
    for p in model.parameters():
        dist.all_reduce(p.grad.data, op=dist.ReduceOp.SUM)
        p.grad.data /= size


def ddpkit_options(hook: str | None, comm: str | None) -> dict:
    if hook is None:
        return {} if comm is None else {"comm": comm}
    if hook == "shm":
        from ddpkit.comm.shm.hook import ShmState, shm_hook

        return {"comm_hook": shm_hook, "comm_state": ShmState()}
    from ddpkit.parallel.hooks import HOOKS

    return {"comm_hook": HOOKS[hook]}


def make_batches(batch: int, rank: int, round_index: int, sizes: tuple[int, ...]) -> list:
    g = torch.Generator().manual_seed(1000 * round_index + 1 + rank)
    return [(torch.randn(batch, sizes[0], generator=g),
             torch.randint(0, sizes[-1], (batch,), generator=g)) for _ in range(4)]


def build(name: str, base: nn.Module, opts: dict) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    cap = {} if opts["bucket_cap_mb"] is None else {"bucket_cap_mb": opts["bucket_cap_mb"]}
    if name in (*COMPUTE_ONLY, "naive"):
        return model
    if name == "torch":
        return DDP(model, **cap)
    if name == "torch_gbv":
        return DDP(model, gradient_as_bucket_view=True, **cap)
    if name == "torch_shm":
        from ddpkit.comm.shm.hook import ShmState, shm_hook

        ddp = DDP(model, **cap)
        ddp.register_comm_hook(ShmState(), shm_hook)
        return ddp
    if name == "ddpkit":
        return ddpkit.DataParallel(model, **cap, **ddpkit_options(opts["hook"], opts["comm"]))
    if name == "ddpkit_backend":
        return ddpkit.DataParallel(model, comm="backend", **cap)
    if name == "ddpkit_nosum":
        ddp = ddpkit.DataParallel(model, **cap)
        ddp.reducer.transport.all_reduce = lambda buffer: None  # timing only: no sum
        return ddp
    if name == "ddpkit_unarmed":
        ddp = ddpkit.DataParallel(model, **cap)
        ddp.reducer.arm = lambda divisor: None  # timing only: hooks return at once
        return ddp
    if name == "ddpkit_nocopy":
        ddp = ddpkit.DataParallel(model, **cap)
        # timing only: the gradient is counted as in its bucket but never copied there
        ddp.reducer._mark_ready = lambda i, param: ddp.reducer._count_ready(i)
        return ddp
    raise SystemExit(f"ddp_step: unknown variant {name!r}; known: {', '.join(VARIANTS)}")


VARIANTS = ("single", "local", "local_synced", "torch", "torch_gbv", "torch_shm", "naive",
            "ddpkit", "ddpkit_backend", "ddpkit_nosum", "ddpkit_unarmed", "ddpkit_nocopy")
COMPUTE_ONLY = ("single", "local", "local_synced")  # no DDP: the ceilings
TIMING_ONLY = ("ddpkit_nosum", "ddpkit_unarmed", "ddpkit_nocopy")  # parameters not synchronized
UNCHECKED = (*COMPUTE_ONLY, *TIMING_ONLY)


def worker(world: ddpkit.World, opts: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = make_mlp(opts["sizes"])
    W, rank = world.world_size, world.rank
    names = list(opts["variants"])
    models = {n: build(n, base, opts) for n in names}
    optimizers = {n: torch.optim.SGD(models[n].parameters(), lr=0.01) for n in names}
    steps_done: dict[str, int] = {}
    times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}  # minor page faults per step

    batches: list = []

    def step(name: str) -> float:
        model, opt = models[name], optimizers[name]
        x, y = batches[steps_done[name] % len(batches)]
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if name == "local_synced":
            paused = time.perf_counter()
            ddpkit.comm.barrier()  # shm on one host: every rank leaves within microseconds
            start += time.perf_counter() - paused
        if name == "naive":
            naive_average_gradients(model)
        opt.step()
        elapsed = time.perf_counter() - start
        faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
        steps_done[name] += 1
        return elapsed

    for round_index in range(opts["rounds"]):
        batches = make_batches(opts["batch"], rank, round_index, opts["sizes"])
        steps_done = dict.fromkeys(names, 0)
        for name in random.Random(round_index).sample(names, len(names)):
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
                      for n in names if n not in UNCHECKED and "torch" in names}
    checksums = {n: float(sum(p.double().sum() for p in params(n))) for n in names
                 if n not in UNCHECKED}
    gathered: list = [None] * W
    dist.all_gather_object(gathered, checksums)
    replicas_equal = {n: len({c[n] for c in gathered}) == 1 for n in checksums}
    return {"times": times, "faults": faults, "equal_to_torch": equal_to_torch,
            "replicas_equal": replicas_equal,
            "comm": {n: getattr(models[n], "comm", None) for n in names}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket cap for every DDP variant (default: each engine's own, 25 MiB)")
    p.add_argument("--comm", default=None, choices=["auto", "backend", "ring", "shm"],
                   help="DataParallel(comm=...) of the ddpkit variant (default: its default)")
    p.add_argument("--hook", default=None,
                   choices=["allreduce", "ring", "fp16_compress", "bf16_compress", "shm"],
                   help="comm hook for the ddpkit variant instead")
    p.add_argument("--variants", default="single,local,torch,torch_gbv,torch_shm,ddpkit",
                   help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--sizes", default="-".join(map(str, SIZES)),
                   help="the MLP's layer widths, input first (default: the 8.4M-parameter MLP)")
    p.add_argument("--json", default=os.path.join("benchmarks", "results", "ddp_step.json"))
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    opts = {"batch": args.batch, "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "bucket_cap_mb": args.bucket_cap_mb, "hook": args.hook,
            "comm": args.comm, "variants": variants,
            "sizes": tuple(int(w) for w in args.sizes.split("-"))}
    n_params = sum(p.numel() for p in make_mlp(opts["sizes"]).parameters())
    print(f"ddp_step: MLP {'-'.join(map(str, opts['sizes']))} ({n_params / 1e6:.1f}M params), "
          f"batch {args.batch}/rank, {args.world_size} ranks gloo, 1 thread/rank, "
          f"ddpkit comm={args.comm or 'default'} hook={args.hook or 'none'}", file=sys.stderr)
    load_before = os.getloadavg()
    results = ddpkit.spawn(worker, nprocs=args.world_size, args=(opts,))
    load_after = os.getloadavg()
    r0 = results[0]
    medians = {n: statistics.median(ts) * 1e3 for n, ts in r0["times"].items() if ts}
    ref = {k: medians.get(k) for k in ("torch", "torch_shm", "single", "local")}

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    rows = []
    columns = ("median ms", "vs torch", "vs torch_shm", "eff single", "eff local",
               "== torch", "replicas ==", "faults/step")
    print(f"\n{'variant':15}" + "".join(f"{c:>13}" for c in columns))
    for name, ms in medians.items():
        compute_only = name in COMPUTE_ONLY
        row = {"variant": name, "comm": r0["comm"].get(name), "median_ms": round(ms, 2),
               "vs_torch": ratio(ms, ref["torch"]),
               "vs_torch_shm": ratio(ms, ref["torch_shm"]),
               "efficiency_vs_single": None if name == "single" else ratio(ref["single"], ms),
               "efficiency_vs_local": None if compute_only else ratio(ref["local"], ms),
               "bitwise_equal_to_torch": r0["equal_to_torch"].get(name),
               "replicas_equal": (None if name in UNCHECKED else
                                  all(r["replicas_equal"].get(name, True) for r in results)),
               "page_faults_per_step": statistics.median(r0["faults"][name]),
               "samples": len(r0["times"][name]),
               # each round's median: the spread between rounds (steps come round by round)
               "round_medians_ms": [round(statistics.median(r0["times"][name][i:i + args.steps])
                                          * 1e3, 2)
                                    for i in range(0, len(r0["times"][name]), args.steps)]}
        rows.append(row)

        def fmt(v):
            text = "-" if v is None else str(v) if isinstance(v, bool) else f"{v:.3f}"
            return f"{text:>13}"

        print(f"{name:15}{ms:13.1f}" + "".join(fmt(row[k]) for k in (
            "vs_torch", "vs_torch_shm", "efficiency_vs_single", "efficiency_vs_local",
            "bitwise_equal_to_torch", "replicas_equal")) + f"{row['page_faults_per_step']:13.0f}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"({os.cpu_count()} cores)")
    report = {"benchmark": "ddp_step", "argv": sys.argv[1:], "model_params": n_params,
              "world_size": args.world_size, "batch_per_rank": args.batch, "hook": args.hook,
              "comm": args.comm, "torch": torch.__version__, "rows": rows,
              "loadavg_before": load_before, "loadavg_after": load_after}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
