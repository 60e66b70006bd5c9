"""Bus-bandwidth benchmark of ddpkit.comm algorithms, side by side in one run.

Numbers follow nccl-tests (PERFORMANCE.md there): ``algbw = bytes / time`` and
``busbw = algbw * factor``, where the factor turns algorithm bandwidth into the
bandwidth each link must sustain, so collectives and rank counts compare on one scale:
all_reduce 2(n-1)/n, reduce_scatter and all_gather (n-1)/n, broadcast and reduce 1.
``bytes`` is the largest buffer of the call (the all_gather output, the
reduce_scatter input), as in nccl-tests. GB/s means 1e9 bytes per second.

Method: every rank runs the same sweep; for each size, the algorithms take turns
(warm-up rounds, then ``repeats`` timed rounds, alternating algorithms inside each
round) so background noise hits all of them alike. A timed round is a barrier, then
``iters`` back-to-back calls (more for tiny sizes, so one round lasts at least
``_ROUND_S``), and
its time is the slowest rank's. The table reports the median round.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ddpkit.bench.output import pyplot, save_figure, save_json, write_csv
from ddpkit.errors import ConfigError

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_ROUND_S = 0.02  # a timed round lasts at least this long, so barrier skew stays small


def bus_factor(op: str, nranks: int) -> float:
    if op == "all_reduce":
        return 2 * (nranks - 1) / nranks
    if op in ("reduce_scatter", "all_gather"):
        return (nranks - 1) / nranks
    return 1.0


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 4096, 64K, 16M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_sizes(spec: str) -> list[int]:
    """``1K:256M`` (powers of two from 1K to 256M), ``1K:256M:4`` (every 4x), or a
    comma list ``1K,16M``."""
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"--sizes {spec!r}: use MIN:MAX or MIN:MAX:FACTOR")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else 2
        if len(parts) == 3 and not parts[2].isdigit() or factor < 2:
            raise ConfigError(f"--sizes {spec!r}: FACTOR must be an integer >= 2")
        if lo < 1 or hi < lo:
            raise ConfigError(f"--sizes {spec!r}: need 1 <= MIN <= MAX")
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= factor
        return sizes
    sizes = [parse_size(p) for p in spec.split(",") if p.strip()]
    if not sizes:
        raise ConfigError("--sizes is empty")
    return sizes


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class BenchConfig:
    op: str = "all_reduce"
    algos: tuple[str, ...] = ("ring", "backend")
    sizes: tuple[int, ...] = tuple(parse_sizes("1K:256M"))
    dtype: str = "float32"
    nproc: int = 2
    warmup: int = 2
    repeats: int = 7
    check: bool = True
    threads: int | None = None  # torch intra-op threads per rank; None: cores / nproc


@dataclass
class Row:
    op: str
    algo: str
    nranks: int
    bytes: int
    elements: int
    dtype: str
    time_us: float  # median round, per call
    algbw_gbps: float
    busbw_gbps: float
    time_us_min: float
    time_us_max: float
    repeats: int
    iters: int


@dataclass
class BenchResult:
    config: BenchConfig
    rows: list[Row]
    meta: dict = field(default_factory=dict)

    def ratios(self, algo: str, baseline: str, min_bytes: int = 16 << 20) -> list[float]:
        """busbw(algo) / busbw(baseline) for each size >= ``min_bytes`` measured for both."""
        by = {(r.algo, r.bytes): r for r in self.rows}
        out = []
        for (a, size), row in sorted(by.items(), key=lambda kv: kv[0][1]):
            base = by.get((baseline, size))
            if a == algo and size >= min_bytes and base and base.busbw_gbps > 0:
                out.append(row.busbw_gbps / base.busbw_gbps)
        return out


# -- what runs on every rank ---------------------------------------------------------


class _Case:
    """Buffers and one call of ``op`` with ``algo`` at one size."""

    def __init__(self, op: str, nbytes: int, dtype: torch.dtype, nranks: int):
        esize = torch.empty((), dtype=dtype).element_size()
        count = max(nbytes // esize, 1)
        if op in ("all_gather", "reduce_scatter"):
            count = max(count // nranks, 1) * nranks
        self.op, self.count = op, count
        self.bytes = count * esize
        if op == "all_gather":
            self.input = torch.zeros(count // nranks, dtype=dtype)
            self.output = torch.zeros(count, dtype=dtype)
        elif op == "reduce_scatter":
            self.input = torch.zeros(count, dtype=dtype)
            self.output = torch.zeros(count // nranks, dtype=dtype)
        else:
            self.input = self.output = torch.zeros(count, dtype=dtype)

    def call(self, algo: str, tensor_in=None, tensor_out=None) -> None:
        from ddpkit import comm

        x = self.input if tensor_in is None else tensor_in
        y = self.output if tensor_out is None else tensor_out
        if self.op == "all_reduce":
            comm.all_reduce(x, algo=algo)
        elif self.op == "reduce_scatter":
            comm.reduce_scatter(y, x, algo=algo)
        elif self.op == "all_gather":
            comm.all_gather(y, x, algo=algo)
        elif self.op == "broadcast":
            comm.broadcast(x, 0, algo=algo)
        else:
            comm.reduce(x, 0, algo=algo)

    def check(self, algo: str, rank: int) -> None:
        """One call on rank-dependent data, compared with torch's own collective."""
        def fresh():
            x = torch.full_like(self.input, rank + 1)
            x[:: max(1, x.numel() // 7)] = rank + 2
            return x, torch.zeros_like(self.output) if self.output is not self.input else None

        ours_in, ours_out = fresh()
        ref_in, ref_out = fresh()
        self.call(algo, ours_in, ours_out)
        self.call("backend", ref_in, ref_out)
        got = ours_out if ours_out is not None else ours_in
        want = ref_out if ref_out is not None else ref_in
        if self.op == "reduce" and rank != 0:
            return  # only dst's result is defined
        if not torch.equal(got, want):
            raise RuntimeError(
                f"{algo} {self.op} of {self.count} elements disagrees with torch's result"
            )


def _round_time(case: _Case, algo: str, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        case.call(algo)
    return (time.perf_counter() - start) / iters


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_rank(world, cfg: BenchConfig) -> list[dict] | None:
    """The sweep every rank runs (``ddpkit.spawn`` target); rank 0 returns the rows."""
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // cfg.nproc))
    dtype = DTYPES[cfg.dtype]
    rows: list[Row] = []
    for i, nbytes in enumerate(cfg.sizes):
        case = _Case(cfg.op, nbytes, dtype, world.world_size)
        if cfg.check:
            for algo in cfg.algos:
                if algo != "backend":
                    case.check(algo, world.rank)
        warm = {a: 0.0 for a in cfg.algos}
        for _ in range(max(cfg.warmup, 1)):
            for algo in cfg.algos:
                warm[algo] = _round_time(case, algo, 1)
        estimate = _slowest([warm[a] for a in cfg.algos])
        iters = {
            a: max(1, min(200, math.ceil(_ROUND_S / max(t, 1e-6))))
            for a, t in zip(cfg.algos, estimate)
        }
        samples: dict[str, list[float]] = {a: [] for a in cfg.algos}
        for _ in range(cfg.repeats):
            for algo in cfg.algos:
                samples[algo].append(_round_time(case, algo, iters[algo]))
        factor = bus_factor(cfg.op, world.world_size)
        line = []
        for algo in cfg.algos:
            times = _slowest(samples[algo])
            med = statistics.median(times)
            algbw = case.bytes / med / 1e9
            rows.append(Row(cfg.op, algo, world.world_size, case.bytes, case.count, cfg.dtype,
                            med * 1e6, algbw, algbw * factor, min(times) * 1e6,
                            max(times) * 1e6, cfg.repeats, iters[algo]))
            line.append(f"{algo} {algbw * factor:.3f}")
        if world.rank == 0:
            print(f"[{i + 1}/{len(cfg.sizes)}] {human_bytes(case.bytes):>10}  busbw GB/s: "
                  + ", ".join(line), file=sys.stderr, flush=True)
        del case
    return [asdict(r) for r in rows] if world.rank == 0 else None


# -- the parent: spawn, report, write files ------------------------------------------


def check_config(cfg: BenchConfig) -> None:
    from ddpkit.comm import registry

    if cfg.op not in OPS:
        raise ConfigError(f"--op {cfg.op!r} is not one of {', '.join(OPS)}")
    if cfg.nproc < 2:
        raise ConfigError(f"--nproc-per-node must be >= 2 (a collective needs peers), "
                          f"got {cfg.nproc}")
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"--dtype {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    if cfg.repeats < 1 or cfg.warmup < 0:
        raise ConfigError("--repeats must be >= 1 and --warmup >= 0")
    if not cfg.algos:
        raise ConfigError("--algo is empty")
    known = ("auto", *registry.algorithms())
    for algo in cfg.algos:
        if algo not in known:
            raise ConfigError(f"--algo {algo!r} is not registered; known: {', '.join(known)}")
    if len(set(cfg.algos)) != len(cfg.algos):
        raise ConfigError(f"--algo lists a name twice: {','.join(cfg.algos)}")


def run(cfg: BenchConfig) -> BenchResult:
    from ddpkit.runtime.spawn import spawn

    check_config(cfg)
    started = time.time()
    per_rank = spawn(run_rank, cfg.nproc, args=(cfg,))
    rows = [Row(**r) for r in per_rank[0]]
    meta = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
        "host_cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "command": " ".join(["ddpkit", *sys.argv[1:]]) if sys.argv else "",
    }
    return BenchResult(cfg, rows, meta)


def collectives_table(result: BenchResult) -> str:
    cfg = result.config
    algos = list(cfg.algos)
    baseline = "backend" if "backend" in algos and len(algos) > 1 else None
    others = [a for a in algos if a != baseline] if baseline else []
    head1 = f"#{'':>12} {'':>12}" + "".join(f" | {a:^26}" for a in algos)
    head2 = f"#{'size':>12} {'count':>12}" + " | {:>8} {:>8} {:>8}".format(
        "time", "algbw", "busbw") * len(algos)
    head3 = f"#{'(B)':>12} {'(elements)':>12}" + " | {:>8} {:>8} {:>8}".format(
        "(us)", "(GB/s)", "(GB/s)") * len(algos)
    if others:
        head1 += " |"
        head2 += " |" + "".join(f" {a + '/' + baseline:>18}" for a in others)
        head3 += " |" + "".join(f" {'(busbw)':>18}" for _ in others)
    lines = [
        f"# ddpkit bench collectives: {cfg.op}, {cfg.nproc} ranks, {cfg.dtype}, "
        f"median of {cfg.repeats} rounds after {cfg.warmup} warm-up; "
        f"busbw factor {bus_factor(cfg.op, cfg.nproc):.3g}",
        head1, head2, head3,
    ]
    by = {(r.algo, r.bytes): r for r in result.rows}
    for size in sorted({r.bytes for r in result.rows}):
        first = next(r for r in result.rows if r.bytes == size)
        line = f" {size:>12} {first.elements:>12}"
        for algo in algos:
            r = by[(algo, size)]
            line += f" | {r.time_us:>8.1f} {r.algbw_gbps:>8.3f} {r.busbw_gbps:>8.3f}"
        if others:
            line += " |"
            for algo in others:
                base = by[(baseline, size)].busbw_gbps
                ratio = by[(algo, size)].busbw_gbps / base if base > 0 else float("nan")
                line += f" {ratio:>17.2f}x"
        lines.append(line)
    for algo in others:
        ratios = result.ratios(algo, baseline)
        if ratios:
            lines.append(
                f"# {algo}/{baseline} busbw at >= 16 MiB: median {statistics.median(ratios):.2f}x"
                f" (min {min(ratios):.2f}x, max {max(ratios):.2f}x, {len(ratios)} sizes)"
            )
    return "\n".join(lines)


def _stem(out_dir: str, op: str) -> str:
    return os.path.join(out_dir, f"collectives-{op}")


def refuse_taken_out_dir(out_dir: str, op: str) -> None:
    """Refuse a directory that already holds this op's results: nothing is overwritten."""
    stem = _stem(out_dir, op)
    taken = [p for p in (stem + ".csv", stem + ".json", stem + ".png") if os.path.exists(p)]
    if taken:
        raise ConfigError(f"{taken[0]} already exists; pass another --out-dir")


def write_outputs(result: BenchResult, out_dir: str, plot: bool = True) -> list[str]:
    """collectives-<op>.csv, .json and (unless ``plot=False``) .png in ``out_dir``."""
    refuse_taken_out_dir(out_dir, result.config.op)
    os.makedirs(out_dir, exist_ok=True)
    stem = _stem(out_dir, result.config.op)
    paths = [stem + ".csv", stem + ".json"]
    write_csv(paths[0], [asdict(r) for r in result.rows], value=_csv_value, lineterminator="\n")
    save_json(paths[1], {"config": asdict(result.config), "meta": result.meta,
                          "rows": [asdict(r) for r in result.rows]}, indent=2, final_newline=True)
    if plot:
        paths.append(stem + ".png")
        _plot(result, paths[-1])
    return paths


def _csv_value(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _short_bytes(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _plot(result: BenchResult, path: str) -> None:
    cfg = result.config
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    for algo in cfg.algos:
        rows = sorted((r for r in result.rows if r.algo == algo), key=lambda r: r.bytes)
        ax.plot([r.bytes for r in rows], [r.busbw_gbps for r in rows], marker="o", label=algo)
    ax.set_xscale("log", base=2)
    sizes = sorted({r.bytes for r in result.rows})
    ticks = sizes if len(sizes) <= 8 else sizes[:: math.ceil(len(sizes) / 8)]
    ax.set_xticks(ticks, [_short_bytes(s) for s in ticks])
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{cfg.op}, {cfg.nproc} ranks, {cfg.dtype} (median of {cfg.repeats})")
    save_figure(fig, (ax,), path, dpi=110)
