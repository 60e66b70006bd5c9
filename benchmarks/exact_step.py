"""Exact mode vs the default mode: step time at the same global batch, and where exact
mode's time goes.

Models (side by side in the same processes: gloo, W ranks, 1 torch thread per rank):

* ``main``  - the main job's model (``ddpkit train`` defaults: MLP 64-128-10 on 8x8
  digits inputs), global batch ``--main-batch`` (128, the main job's);
* ``mlp8m`` - the 8.4M-parameter MLP of benchmarks/ddp_step.py, at each global batch
  of ``--mlp-batches``.

Variants per model and batch, interleaved round by round in a fresh random order (the
same on every rank), every round on fresh random batches:

* ``default``  - ``DataParallel(model)``: one forward/backward of the local batch;
* ``exact``    - ``DataParallel(model, exact=True, slices=V)``, V the default
  for the global batch (``ddpkit.slice_count.default_slices``) or ``--slices``;
* ``exact_1pr`` - exact mode with V = W: one slice per rank, so the gap to ``default``
  is the exact sum alone, and the gap to ``exact`` the cost of more, smaller passes;
* ``exact_compiled``, ``exact_eager``, ``exact_f64``, ``exact_gather`` and the same for
  ``exact_1pr`` (with ``--sum-variants``) - the sum's ways side by side: the int32
  format's passes always compiled (``DDPKIT_EXACT_COMPILE=1``; on a model whose default
  is another format, that format: the setting only applies to int32), always eager
  (``=0``), the float64 format (``DDPKIT_EXACT_SUM=float64``; its passes are eager
  torch operations) and the gather format (``DDPKIT_EXACT_SUM=gather``);
* ``floor``, ``floor_1pr`` (with ``--floor``) - the same slices (V, and V = W) in plain
  torch on the bare module, no engine, no sum, deterministic algorithms on: what exact
  mode's smaller passes cost by themselves, the floor under its step time;
* ``exact_base``, ``exact_1pr_base`` (with ``--baseline-src DIR``) - the same two, with
  the exact-mode reducer and sum of another ddpkit source tree (DIR: its ``src``, e.g.
  of a ``git worktree`` of an older commit), to compare two implementations in the
  same processes.

A step is ``zero_grad`` + forward/backward (per slice in exact mode, mean loss per
slice) + ``SGD.step``, each variant with the process-wide settings its mode has
(exact mode: torch's deterministic algorithms on); reported is the median on rank 0.
Exact steps are also taken apart (medians per step, rank 0): the sum's phases (local
max, the MAX all-reduce, encode, the SUM all-reduce, decode; in the gather format the
all-gather and the adding, the fold format's local levels included) and the rest (the slices'
forward and backward, zero_grad and the SGD step).

The workers run with the heap settings ``ddpkit launch`` and ``ddpkit train`` give
theirs (:mod:`ddpkit.launcher.worker_heap`; ``DDPKIT_SYSTEM_MALLOC=1`` keeps glibc's defaults).

Run:  python benchmarks/exact_step.py [--world-size 2 --rounds 7 --json out.json]
      [--baseline-src /path/to/other/checkout/src] [--sum-variants]
"""

from __future__ import annotations

import argparse
import collections
import copy
import hashlib
import importlib.util
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.bench.output import save_json
from ddpkit.launcher.worker_heap import worker_malloc_env
from ddpkit.parallel.exact.exact_compile import COMPILE_ENV
from ddpkit.parallel.exact.exact_gather import ExactMeanGather
from ddpkit.parallel.exact.exact_sum import ExactMean
from ddpkit.parallel.exact.exact_sum32 import FORMAT_ENV, ExactMean32
from ddpkit.parallel.exact.exact_transport import ExactTransport
from ddpkit.slice_count import default_slices
from ddpkit.train.models import MLP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import make_mlp  # noqa: E402  (the 8.4M-parameter benchmark MLP)

PHASES = ("max", "all_reduce_max", "encode", "all_reduce_sum", "decode", "barrier",
          "all_gather", "add")
_spent: dict[str, float] = collections.defaultdict(float)  # phase -> seconds, this step


def _timed(name: str, fn):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[name] += time.perf_counter() - start

    return run


# What a tree from before parallel/'s subpackages imports for exact mode, and its name here.
_OLD_HOMES = {
    "from ddpkit.parallel import transport": "from ddpkit.parallel.engine import transport",
    "from ddpkit.parallel.exact_slices import": "from ddpkit.parallel.exact.slices import",
    "from ddpkit.parallel.state_sync import": "from ddpkit.parallel.engine.state_sync import",
    "transport.resolve(": "transport.resolve_comm(",
}


def _load_baseline(src: str):
    """The exact-mode reducer module of the ddpkit source tree ``src``, loaded beside
    this one (as ``baseline_exact_reducer``, using that tree's exact sums, kept
    gradients and slice loop; the transport is this tree's): from its
    ``parallel/exact/`` package, or from ``parallel/`` in a tree from before it (whose
    imports are pointed at their homes here)."""
    package = os.path.join(src, "ddpkit", "parallel", "exact")
    old = not os.path.isdir(package)
    where = os.path.dirname(package) if old else package
    prefix = "ddpkit.parallel." if old else "ddpkit.parallel.exact."
    modules = {}
    own_modules = ("exact_kernels", "exact_compile", "exact_sum", "exact_sum32")
    if not old:  # that tree's gather sum, kept gradients and slice loop too
        own_modules = ("exact_kernels", "exact_compile", "exact_sum", "exact_gather",
                       "kept_grads", "slices", "exact_sum32")
    for name in (*own_modules, "exact_reducer"):
        path = os.path.join(where, f"{name}.py")
        if not os.path.exists(path):  # a tree from before the int32 format
            continue
        with open(path) as f:
            text = f.read()
        for own in own_modules:  # that tree's sum and passes, not this one's
            text = text.replace(f"from {prefix}{own} import", f"from baseline_{own} import")
            text = text.replace(f"from {prefix.rstrip('.')} import {own}\n",
                                f"import baseline_{own} as {own}\n")
        for was, now in _OLD_HOMES.items() if old else ():
            text = text.replace(was, now)
        spec = importlib.util.spec_from_loader(f"baseline_{name}", loader=None)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        exec(compile(text, path, "exec"), module.__dict__)
        modules[name] = module
    return (modules["exact_reducer"], modules["exact_sum"], modules.get("exact_sum32"),
            modules.get("exact_gather"))


def _baseline_model(baseline, module: nn.Module, slices: int):
    """An exact DataParallel whose reducer is the baseline tree's, and its slice loop (a
    tree from before exact mode's own transport: that reducer is the transport too)."""
    model = ddpkit.DataParallel(module, exact=True, slices=slices)
    model.reducer.remove_hooks()
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if hasattr(baseline, "attach"):
        model.transport.close()
        reducer = baseline.ExactReducer(module, trainable, None, slices=slices, comm="auto",
                                        find_unused_parameters=False)
        model.transport = reducer
    else:
        reducer = baseline.ExactReducer(module, trainable, None, model.transport,
                                        slices=slices, find_unused_parameters=False)
    model.reducer = reducer
    return model, lambda *tensors: reducer.slices(tensors)


def _instrument(transport=ExactTransport, mean=ExactMean, reducer=None) -> None:
    """Time the exact sum's phases (benchmark only: wraps the methods in place): the
    two all-reduces where ``transport`` runs them, or (a tree from before exact mode's
    own transport) where ``reducer`` did."""
    # the entry points the sum runs through (this tree's, or an older one's)
    mean_max = "_local_max" if hasattr(mean, "_local_max") else "local_max"
    mean_encode = "_encode" if hasattr(mean, "_encode") else "encode"
    setattr(mean, mean_max, _timed("max", getattr(mean, mean_max)))
    setattr(mean, mean_encode, _timed("encode", getattr(mean, mean_encode)))
    mean_decode = "_decode" if hasattr(mean, "_decode") else "decode"
    setattr(mean, mean_decode, _timed("decode", getattr(mean, mean_decode)))
    if reducer is not None:
        collective = reducer._collective

        def timed_collective(self, op):
            return _timed(f"all_reduce_{op}", collective(self, op))

        reducer._collective = timed_collective
        return
    if transport is not None:
        transport.max_ = _timed("all_reduce_max", transport.max_)
        transport.sum_ = _timed("all_reduce_sum", transport.sum_)
        if hasattr(transport, "gather_"):
            transport.gather_ = _timed("all_gather", transport.gather_)
        if hasattr(transport, "barrier"):  # the int32 sum reading peers' rows in place
            transport.barrier = _timed("barrier", transport.barrier)


def _plain_slices(per_rank: int):
    """The floor of exact mode's smaller passes: this rank's slices cut the same way
    (contiguous copies), run on the bare module in plain torch, no engine, no sum."""
    def loop(*tensors):
        for m in range(per_rank):
            yield tuple(t[m::per_rank].contiguous() for t in tensors)

    return loop


def _main_model() -> nn.Module:
    return MLP(64, 10, (128,))


def _cases(opts: dict) -> list[tuple[str, int, int, int]]:
    """(model, global batch, input width, V) per case."""
    cases = [("main", opts["main_batch"], 64, opts["slices"] or
              default_slices(opts["main_batch"]))]
    for b in opts["mlp_batches"]:
        cases.append(("mlp8m", b, 1024, opts["slices"] or default_slices(b)))
    return cases


# --sum-variants: suffix -> (environment while the engine is built, while it steps)
SUM_VARIANTS = {"_compiled": ({}, {COMPILE_ENV: "1"}),
                "_eager": ({}, {COMPILE_ENV: "0"}),
                "_f64": ({FORMAT_ENV: "float64"}, {}),
                "_gather": ({FORMAT_ENV: "gather"}, {})}


def _set_env(settings: dict[str, str]) -> dict[str, str | None]:
    """Apply ``settings`` to the environment; what they replaced (None: unset)."""
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    return before


def _restore_env(before: dict[str, str | None]) -> None:
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def worker(world: ddpkit.World, opts: dict) -> dict:
    torch.set_num_threads(1)
    _instrument()
    _instrument(transport=None, mean=ExactMean32)  # the int32 format's sum
    ExactMeanGather.add = _timed("add", ExactMeanGather.add)  # the gather format's sum
    ExactMeanGather.fold_local = _timed("add", ExactMeanGather.fold_local)  # fold's, local
    baseline = None
    if opts["baseline_src"]:
        baseline, baseline_sum, baseline_sum32, baseline_gather = _load_baseline(
            opts["baseline_src"])
        if baseline_gather is not None:  # that tree's gather and fold sums
            gather = baseline_gather.ExactMeanGather
            gather.add = _timed("add", gather.add)
            if hasattr(gather, "fold_local"):
                gather.fold_local = _timed("add", gather.fold_local)
        if hasattr(baseline, "attach"):
            _instrument(mean=baseline_sum.ExactMean, reducer=baseline.ExactReducer)
        else:  # on this tree's transport, timed already
            _instrument(transport=None, mean=baseline_sum.ExactMean)
        if baseline_sum32 is not None:
            _instrument(transport=None, mean=baseline_sum32.ExactMean32)
    W, rank = world.world_size, world.rank
    runs = {}
    for model_name, batch, width, v in _cases(opts):
        torch.manual_seed(0)
        base = _main_model() if model_name == "main" else make_mlp()
        variants = [("default", None), ("exact", v), ("exact_1pr", W)]
        if baseline is not None:
            variants += [("exact_base", v), ("exact_1pr_base", W)]
        if opts["sum_variants"]:
            variants += [(f"exact{one}{suffix}", s) for one, s in (("", v), ("_1pr", W))
                         for suffix in SUM_VARIANTS]
        if opts["floor"]:
            variants += [("floor", v), ("floor_1pr", W)]
        for variant, slices in variants:
            if slices is not None and (batch % slices or slices % W):
                continue
            module = copy.deepcopy(base)
            if slices is None:
                model, slice_loop = ddpkit.DataParallel(module), None
            elif variant.startswith("floor"):
                model, slice_loop = module, _plain_slices(slices // W)
            elif variant.endswith("_base"):
                model, slice_loop = _baseline_model(baseline, module, slices)
            else:
                build_env, _ = SUM_VARIANTS.get(variant[variant.rfind("_"):], ({}, {}))
                before = _set_env(build_env)
                model = ddpkit.DataParallel(module, exact=True, slices=slices)
                _restore_env(before)
                slice_loop = model.slices
            torch.set_num_threads(1)  # exact mode pins 1 too; the default the same
            runs[(model_name, batch, variant)] = {
                "model": model, "slice_loop": slice_loop,
                "opt": torch.optim.SGD(model.parameters(), lr=0.01),
                "slices": slices, "width": width, "batch": batch, "times": [],
                "first": [], "later": [],
                "step_env": SUM_VARIANTS.get(variant[variant.rfind("_"):], ({}, {}))[1],
                "phases": collections.defaultdict(list)}
    keys = list(runs)
    for round_index in range(opts["rounds"]):
        g = torch.Generator().manual_seed(1000 * round_index + 1 + rank)
        data = {}  # per model and batch: every variant of a case steps on the same data
        for key in keys:
            r = runs[key]
            local = r["batch"] // W
            if key[:2] not in data:
                data[key[:2]] = (torch.randn(local, r["width"], generator=g),
                                 torch.randint(0, 10, (local,), generator=g))
        for key in random.Random(round_index).sample(keys, len(keys)):
            r = runs[key]
            x, y = data[key[:2]]
            # untimed steps first: the warmup in the first round, then ``settle`` steps
            # each round (the variant's first step after another variant's, whose
            # memory traffic, tens of MB on the 8.4M MLP, left the caches cold)
            untimed = opts["warmup"] if round_index == 0 else opts["settle"]
            steps = opts["steps"] + untimed
            # Process-wide settings as each mode has them: exact mode turns on torch's
            # deterministic algorithms (building an exact engine did it for everyone).
            torch.use_deterministic_algorithms(r["slices"] is not None, warn_only=True)
            before = _set_env(r["step_env"])
            for i in range(steps):
                dist.barrier()
                _spent.clear()
                start = time.perf_counter()
                r["opt"].zero_grad()
                model = r["model"]
                if r["slices"] is None:
                    F.cross_entropy(model(x), y).backward()
                else:
                    for xs, ys in r["slice_loop"](x, y):
                        F.cross_entropy(model(xs), ys).backward()
                r["opt"].step()
                elapsed = time.perf_counter() - start
                if round_index > 0 and i >= untimed:  # first timed step of a block, or later
                    r["first" if i == untimed else "later"].append(elapsed)
                if i >= untimed:
                    r["times"].append(elapsed)
                    if r["slices"] is not None:
                        for phase in PHASES:
                            r["phases"][phase].append(_spent.get(phase, 0.0))
            _restore_env(before)
        if rank == 0:
            print(f"  round {round_index + 1}/{opts['rounds']} done", file=sys.stderr, flush=True)
    out = {}
    for (model_name, batch, variant), r in runs.items():
        params = [p.detach() for p in getattr(r["model"], "module", r["model"]).parameters()]
        out[f"{model_name}|{batch}|{variant}"] = {
            "slices": r["slices"], "times": r["times"], "first": r["first"],
            "later": r["later"],
            "phases": {k: list(v) for k, v in r["phases"].items()},
            "checksum": float(sum(p.double().sum() for p in params)),
            # the parameters' bytes: the same steps on the same data give the same
            # digest wherever the same bits come out (exact mode against its baseline)
            "digest": hashlib.sha256(b"".join(p.contiguous().numpy().tobytes()
                                              for p in params)).hexdigest()[:16]}
    return out


def _median_ms(times: list[float]) -> float | None:
    return round(statistics.median(times) * 1e3, 3) if times else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--main-batch", type=int, default=128, help="global batch, main job's model")
    p.add_argument("--mlp-batches", default="128,1024",
                   help="global batches for the 8.4M-parameter MLP (comma-separated)")
    p.add_argument("--slices", type=int, default=None,
                   help="slices for every exact case (default: each batch's default)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--settle", type=int, default=0,
                   help="untimed steps at the start of each variant's block in later rounds")
    p.add_argument("--json", default=os.path.join("benchmarks", "results", "exact_step.json"))
    p.add_argument("--sum-variants", action="store_true",
                   help="also the int32 sum always compiled, always eager, and the float64 sum")
    p.add_argument("--floor", action="store_true",
                   help="also the floor: the same slices in plain torch, no engine, no sum")
    p.add_argument("--baseline-src", default=None,
                   help="another ddpkit source tree (its src/): its exact mode runs too")
    args = p.parse_args(argv)
    opts = {"main_batch": args.main_batch,
            "mlp_batches": [int(b) for b in args.mlp_batches.split(",") if b],
            "slices": args.slices, "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "settle": args.settle,
            "sum_variants": args.sum_variants, "floor": args.floor,
            "baseline_src": os.path.abspath(args.baseline_src) if args.baseline_src else None}
    print(f"exact_step: {args.world_size} ranks gloo, 1 thread/rank, cases "
          f"{_cases(opts)}", file=sys.stderr)
    # The workers get the heap settings `ddpkit launch`/`ddpkit train` give theirs (both
    # modes alike): without them every pass's fresh gradients fault their pages in.
    os.environ.update(worker_malloc_env())
    load_before = os.getloadavg()
    results = ddpkit.spawn(worker, nprocs=args.world_size, args=(opts,))
    load_after = os.getloadavg()
    r0 = results[0]
    rows = []
    print(f"\n{'model':7}{'batch':>7}{'variant':>15}{'V':>4}{'median ms':>11}{'x default':>11}"
          f"{'replicas ==':>13}   exact step taken apart (median ms)")
    defaults = {k.rsplit("|", 1)[0]: statistics.median(v["times"]) * 1e3
                for k, v in r0.items() if k.endswith("|default")}
    for key, r in r0.items():
        model_name, batch, variant = key.split("|")
        ms = statistics.median(r["times"]) * 1e3
        ratio = ms / defaults[f"{model_name}|{batch}"]
        phases = {k: statistics.median(v) * 1e3 for k, v in r["phases"].items() if any(v)}
        if phases:
            # the rest: the slices' forward/backward, zero_grad, SGD
            phases["rest"] = ms - sum(phases.values())
        # (the floor communicates nothing: its replicas differ by design)
        same = "-" if variant.startswith("floor") else (
            len({res[key]["checksum"] for res in results}) == 1)
        rows.append({"model": model_name, "global_batch": int(batch), "variant": variant,
                     "slices": r["slices"], "median_ms": round(ms, 3),
                     "vs_default": round(ratio, 3), "replicas_equal": same,
                     "phases_ms": {k: round(v, 3) for k, v in phases.items()},
                     "samples": len(r["times"]), "params_digest": r["digest"],
                     "quartiles_ms": [round(q * 1e3, 3) for q in
                                      statistics.quantiles(r["times"], n=4)[::2]],
                     # rounds after the first: each block's first timed step against the
                     # later ones (what another variant's steps in between cost it)
                     "first_in_block_ms": _median_ms(r["first"]),
                     "later_in_block_ms": _median_ms(r["later"])})
        parts = "  ".join(f"{k} {v:.2f}" for k, v in phases.items())
        if rows[-1]["later_in_block_ms"] is not None:
            parts = (f"[block first {rows[-1]['first_in_block_ms']:.2f}, later "
                     f"{rows[-1]['later_in_block_ms']:.2f}]  " + parts)
        print(f"{model_name:7}{batch:>7}{variant:>15}{r['slices'] or '-':>4}{ms:11.2f}"
              f"{ratio:11.3f}{same!s:>13}   {parts}")
    digests = {(row["model"], row["global_batch"], row["variant"]): row["params_digest"]
               for row in rows}
    for (model_name, batch, variant), digest in digests.items():
        if variant.endswith("_base"):
            same_bits = digest == digests.get((model_name, batch, variant[:-len("_base")]))
            print(f"{model_name} {batch} {variant[:-len('_base')]}: the same parameters "
                  f"(bits) as the baseline's: {same_bits}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"({os.cpu_count()} cores)")
    report = {"benchmark": "exact_step", "argv": sys.argv[1:], "world_size": args.world_size,
              "torch": torch.__version__, "rows": rows, "loadavg_before": load_before,
              "loadavg_after": load_after}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        print(f"\nwrote {save_json(args.json, report, indent=2, final_newline=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
