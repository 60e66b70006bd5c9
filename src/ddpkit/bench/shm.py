"""Shared-memory all-reduce against gloo, side by side in one launch.

For each message size every rank times, in the same processes, round-robin:

* ``gloo``      torch.distributed.all_reduce on a private tensor (TCP loopback);
* ``comm``      ``ddpkit.comm.all_reduce(t)`` with no argument but the tensor (the door
  most users take: ``algo="auto"`` and the default-on mismatch check) on a private tensor;
* ``comm-nocheck`` the same with ``check=False``. On shm both run the same code (the
  call's signature rides in the barrier every shm call makes, check or not), so the gap
  between these two columns is the spread between identical runs, not a cost;
* ``shm-copy``  ShmCommunicator.all_reduce on a private tensor (copied through the
  shared slots: what any caller gets), with no signature, as the private engine is called;
* ``shm-signed`` the same call carrying the public layer's in-band signature, passed as
  the public door passes it (``signature=`` the word the "shm" algorithm derives from the
  call's signature, per call): ``shm-signed`` vs ``shm-copy`` is what the check costs;
* ``shm``       ShmCommunicator.all_reduce on a tensor from ``allocate()`` (nothing
  copied in or out: what DataParallel's buckets get with the shm hook).

Reported per size: median time per call (the slowest rank's), bus bandwidth
(``bytes * 2(W-1)/W / time``, the all-reduce convention), ratio to gloo, and a
verdict on the targets (shm: busbw >= 3x gloo at >= 4 MiB, latency <= 1/10 of gloo at
<= 64 KiB; comm: >= 20x gloo at <= 64 KiB and >= 4x at 4-32 MiB, and the
in-band check costing <= 10% of the call). Used by ``ddpkit bench shm`` and
``benchmarks/shm.py``.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit.bench.output import pyplot, save_figure, save_json, write_csv

ALGOS = ("gloo", "comm", "comm-nocheck", "shm-copy", "shm-signed", "shm")
DEFAULT_SIZES = "4,1K,16K,64K,256K,1M,4M,16M,32M"
BIG, SMALL = 4 << 20, 64 << 10  # where the bandwidth / latency targets apply


@dataclass(frozen=True)
class Config:
    nprocs: int = 2
    sizes: tuple[int, ...] = ()
    budget_s: float = 0.5  # per size, per algorithm
    rounds: int = 7


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    if text[-1:] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(nbytes: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}B"


def _calls(comm, private: torch.Tensor, shared: torch.Tensor) -> dict:
    from ddpkit import comm as public
    from ddpkit.comm.agreement import CallSignature
    from ddpkit.comm.shm.algorithm import ShmAlgorithm

    # What the public door hands the "shm" algorithm for ``all_reduce(private)`` (its call
    # object carries these fields), and the word the algorithm derives from it per call.
    face = ShmAlgorithm()
    numel, dtype = private.numel(), str(private.dtype).removeprefix("torch.")
    sig = CallSignature("all_reduce", "shm", "sum", dtype, numel, numel, -1, False)

    return {
        "gloo": lambda: dist.all_reduce(private),
        "comm": lambda: public.all_reduce(private),
        "comm-nocheck": lambda: public.all_reduce(private, check=False),
        "shm-copy": lambda: comm.all_reduce(private),
        "shm-signed": lambda: comm.all_reduce(private, "sum", signature=face._word(sig)),
        "shm": lambda: comm.all_reduce(shared),
    }


def _mean_call_time(call, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t.item()


def run_rank(world, cfg: Config) -> list[dict]:
    from ddpkit.comm.shm import ShmCommunicator

    torch.set_num_threads(1)
    rows = []
    with ShmCommunicator() as comm:
        for index, nbytes in enumerate(cfg.sizes):
            numel = max(1, nbytes // 4)
            private = torch.randn(numel)
            shared = comm.allocate(numel, torch.float32)
            shared.copy_(private)
            calls = _calls(comm, private, shared)
            for call in calls.values():  # warm-up: page faults, lazy set-up
                call()
            # Calibrate each algorithm so each (size, algorithm) costs ~budget_s: a round
            # of a few fast calls would be all noise (one preempted rank costs ms).
            iters = {}
            for name, call in calls.items():
                probe = _slowest(_mean_call_time(call, 3))
                iters[name] = int(max(3, min(20000, cfg.budget_s / cfg.rounds / max(probe, 1e-6))))
            samples = {name: [] for name in ALGOS}
            for _ in range(cfg.rounds):  # interleaved: noise hits every algorithm alike
                for name in ALGOS:
                    samples[name].append(_mean_call_time(calls[name], iters[name]))
            times = {name: _slowest(statistics.median(ts)) for name, ts in samples.items()}
            W = world.world_size
            for name in ALGOS:
                t = times[name]
                rows.append({
                    "algo": name, "bytes": numel * 4, "world_size": W, "iters": iters[name],
                    "time_us": round(t * 1e6, 2),
                    "busbw_GBps": round(numel * 4 * 2 * (W - 1) / W / t / 1e9, 4),
                    "speedup_vs_gloo": round(times["gloo"] / t, 3),
                })
            if world.rank == 0:
                print(f"[{index + 1}/{len(cfg.sizes)}] {human(numel * 4):>6}: " + ", ".join(
                    f"{n} {times[n] * 1e6:.0f} us" for n in ALGOS), flush=True)
    return rows


def shm_table(rows: list[dict], nprocs: int) -> str:
    lines = [f"all_reduce float32, {nprocs} ranks, median time per call (slowest rank)",
             f"{'size':>6} {'algo':>12} {'time_us':>10} {'busbw GB/s':>11} {'x gloo':>7}"]
    for r in rows:
        lines.append(f"{human(r['bytes']):>6} {r['algo']:>12} {r['time_us']:>10.1f} "
                     f"{r['busbw_GBps']:>11.3f} {r['speedup_vs_gloo']:>7.2f}")
    lines += verdicts(rows)
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    """One line per target: the worst ratio over the sizes it applies to."""
    out = []
    by = {(r["algo"], r["bytes"]): r for r in rows}
    small = [r["speedup_vs_gloo"] for r in rows if r["algo"] == "comm" and r["bytes"] <= SMALL]
    big = [r["speedup_vs_gloo"] for r in rows
           if r["algo"] == "comm" and BIG <= r["bytes"] <= 32 << 20]
    if small:
        out.append(f"target comm: >= 20x gloo at <= 64K: worst {min(small):.2f}x "
                   f"({'met' if min(small) >= 20 else 'not met'})")
    if big:
        out.append(f"target comm: >= 4x gloo at 4-32M: worst {min(big):.2f}x "
                   f"({'met' if min(big) >= 4 else 'not met'})")
    costs = _ratios(by, "shm-signed", "shm-copy")
    if costs:
        out.append(f"in-band check cost (shm-signed vs shm-copy): worst {max(costs):+.1%} "
                   f"({'met' if max(costs) <= 0.10 else 'not met'}: <= +10%)")
    spread = _ratios(by, "comm", "comm-nocheck")
    if spread:
        worst = max(spread, key=abs)
        out.append(f"spread between identical runs (comm vs comm-nocheck, the same code on "
                   f"shm): largest {worst:+.1%}")
    for algo in ("shm", "shm-copy"):
        big = [r["speedup_vs_gloo"] for r in rows if r["algo"] == algo and r["bytes"] >= BIG]
        small = [r["speedup_vs_gloo"] for r in rows if r["algo"] == algo and r["bytes"] <= SMALL]
        if big:
            out.append(f"target {algo}: busbw >= 3x gloo at >= 4M: worst {min(big):.2f}x "
                       f"({'met' if min(big) >= 3 else 'not met'})")
        if small:
            out.append(f"target {algo}: latency <= 1/10 gloo at <= 64K: worst {min(small):.2f}x "
                       f"faster ({'met' if min(small) >= 10 else 'not met'})")
    return out


def _ratios(by: dict, algo: str, base: str) -> list[float]:
    """``algo``'s time over ``base``'s, minus one, at every size both were timed."""
    return [by[(a, b)]["time_us"] / by[(base, b)]["time_us"] - 1
            for (a, b) in by if a == algo and (base, b) in by]


def write_outputs(rows: list[dict], out_dir: str, plot: bool = True) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "shm.json"), os.path.join(out_dir, "shm.csv")]
    save_json(paths[0], rows, indent=1, final_newline=False)
    write_csv(paths[1], rows)
    if plot:
        paths.append(_plot(rows, os.path.join(out_dir, "shm.png")))
    return paths


def _plot(rows: list[dict], path: str) -> str:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for algo in ALGOS:
        mine = [r for r in rows if r["algo"] == algo]
        sizes = [r["bytes"] for r in mine]
        left.loglog(sizes, [r["time_us"] for r in mine], marker="o", label=algo)
        right.semilogx(sizes, [r["busbw_GBps"] for r in mine], marker="o", label=algo)
    left.set(xlabel="message size (bytes)", ylabel="time per all_reduce (us)", title="latency")
    right.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title="bandwidth")
    return save_figure(fig, (left, right), path, dpi=100)


def run(cfg: Config) -> list[dict]:
    import ddpkit

    return ddpkit.spawn(run_rank, cfg.nprocs, args=(cfg,))[0]
