"""``ddpkit plan``: predict all-reduce and step times, here and at scale.

    ddpkit plan calibrate --out cal.json          # measure all-reduce here, fit alpha/beta
    ddpkit plan validate --calibration cal.json   # predicted vs measured DDP step, 2 ranks
    ddpkit plan project --params 1e9 --gpus 1:1024 --intra nvlink4 --inter ib-ndr
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from ddpkit.commands.old_spellings import keep_old_spellings
from ddpkit.commands.out_dir import fresh_dir
from ddpkit.errors import ConfigError
from ddpkit.plan.model import DEVICES, PRESETS

DESCRIPTION = """\
Predict all-reduce and step times of data-parallel training, here and at scale:

    ddpkit plan calibrate --out cal.json          # time all-reduce here, fit the link
    ddpkit plan validate --calibration cal.json   # predicted vs measured DDP step here
    ddpkit plan project --params 1e9 --gpus 1:1024 --intra nvlink4 --inter ib-ndr
"""


def register(sub) -> None:
    p = sub.add_parser("plan", help="alpha-beta cost model: calibrate, validate, project",
                       description=DESCRIPTION)
    plan_sub = p.add_subparsers(dest="plan_command", metavar="ACTION", required=True)

    c = plan_sub.add_parser("calibrate", help="fit link latency/bandwidth to all-reduce times")
    c.add_argument("--from", dest="from_json", default=None, metavar="BENCH.json",
                   help="a `ddpkit bench collectives` JSON file (default: measure now)")
    c.add_argument("--algo", default="backend", help="which algorithm's rows to fit")
    c.add_argument("--nproc-per-node", type=int, default=2, metavar="N",
                   help="ranks to measure with, on this machine")
    c.add_argument("--sizes", default="4K:64M:4", help="sizes to measure (MIN:MAX:FACTOR)")
    c.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    c.add_argument("--repeats", type=int, default=5, help="timed rounds per size (median)")
    c.add_argument("--out", default="calibration.json", help="where to write the fit")
    c.add_argument("--force", action="store_true", help="replace --out if it exists")
    keep_old_spellings(c, "plan calibrate")
    c.set_defaults(func=run_calibrate)

    v = plan_sub.add_parser("validate", help="predicted vs measured DDP step of an MLP here")
    v.add_argument("--calibration", default=None,
                   help="a `plan calibrate` file (default: fit all-reduces timed in the same "
                        "processes, interleaved with the steps)")
    v.add_argument("--batch", default="16,64", help="per-rank batch sizes to try (comma list)")
    v.add_argument("--widths", default="1024,2048,2048,2048,10", help="MLP layer widths")
    v.add_argument("--bucket-mb", type=float, default=None,
                   help="DDP bucket_cap_mb (default: torch's, 25 MiB with a 1 MiB first bucket)")
    v.add_argument("--steps", type=int, default=12, help="timed steps of each kind")
    v.add_argument("--overlap", default="auto",
                   help="fraction of backward that hides communication (auto: 0 when the "
                        "ranks use every core, else 1)")
    v.add_argument("--out", default=None,
                   help="also write the results as JSON here (default: none)")
    v.set_defaults(func=run_validate)

    j = plan_sub.add_parser(
        "project", help="step time and scaling efficiency at scale",
        description="Predict the step time and weak-scaling efficiency of torch-DDP-style "
                    "training at 1-1024 GPUs and write plan.csv and plan.png.")
    j.add_argument("--params", type=float, default=1e9, help="model parameters")
    j.add_argument("--param-tensors", type=int, default=None, metavar="K",
                   help="gradient tensors (DDP's per-tensor cost; buckets hold equal tensors) "
                        "(default: 4 per --layers block)")
    j.add_argument("--step-ms", type=float, default=None, metavar="MS",
                   help="your measured step of the plain model on one device, no DDP "
                        "(default: estimated from --tokens-per-gpu, --peak-tflops, --mfu)")
    j.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element")
    j.add_argument("--layers", type=int, default=24,
                   help="transformer blocks (bucket layout when --param-tensors is not given)")
    j.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per GPU per step")
    j.add_argument("--device", default="h100",
                   help=f"GPU preset: {', '.join(DEVICES)} (peak FLOP/s, memory bandwidth)")
    j.add_argument("--peak-tflops", type=float, default=None,
                   help="GPU peak TFLOP/s (default: the --device's)")
    j.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak")
    j.add_argument("--spread", type=float, default=None,
                   help="relative spread of the step time between devices (default: the "
                        "--device's, 0.025)")
    j.add_argument("--gpus", default="1:1024", help="MIN:MAX GPUs (powers of two) or a list")
    j.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    j.add_argument("--nics-per-node", type=int, default=None, metavar="N",
                   help="inter-node NICs per node (default: one per GPU)")
    j.add_argument("--intra", default="nvlink4",
                   help=f"intra-node link preset: {', '.join(PRESETS)}")
    j.add_argument("--inter", default="ib-ndr", help="inter-node link preset (per NIC)")
    j.add_argument("--calibration", default=None,
                   help="use a fitted link (a `plan calibrate` file) for both intra and inter "
                        "(default: the presets)")
    j.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB")
    j.add_argument("--overlap", type=float, default=1.0, help="backward/comm overlap, 0..1")
    j.add_argument("--algo", default="ring,tree,hierarchical", help="algorithms to compare")
    j.add_argument("--out-dir", default=None, help="where plan.csv/plan.png go "
                   "(default: runs/plan-<time>)")
    j.add_argument("--no-plot", action="store_true", help="skip the PNG")
    j.set_defaults(func=run_project)


# ------------------------------------------------------------------------- calibrate
def _load_calibration(path: str):
    from ddpkit.plan.calibrate import Calibration

    try:
        return Calibration.from_json(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; run `ddpkit plan calibrate --out {path}` "
                          "first") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON ({exc.msg}); re-create it with "
                          "`ddpkit plan calibrate`") from None


def format_calibration(cal) -> str:
    lines = [f"# all-reduce over {cal.nranks} ranks ({cal.source}): fitted link alpha "
             f"{cal.alpha_s * 1e6:.1f} us per message, "
             f"bandwidth {cal.bandwidth_Bps / 1e9:.3f} GB/s",
             f"#{'size (B)':>11} {'measured':>11} {'predicted':>11} {'error':>8}"]
    errors = cal.errors()
    for nbytes, measured, predicted, err in errors:
        lines.append(f" {nbytes:>11} {measured * 1e6:>9.0f}us {predicted * 1e6:>9.0f}us "
                     f"{err:>+8.1%}")
    worst = max(abs(e[3]) for e in errors)
    median = statistics.median(abs(e[3]) for e in errors)
    lines.append(f"# |error|: median {median:.1%}, worst {worst:.1%}")
    return "\n".join(lines)


def run_calibrate(args) -> int:
    from ddpkit.plan import calibrate

    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"{out} already exists; choose another --out or pass --force")
    if args.from_json:
        points, nranks = calibrate.points_from_bench_json(args.from_json, args.algo)
        source = f"from {args.from_json}"
    else:
        print(f"ddpkit plan calibrate: timing all_reduce on {args.nproc_per_node} ranks, sizes "
              f"{args.sizes}; progress below", file=sys.stderr)
        result = _measure_all_reduce(args.nproc_per_node, args.sizes, args.threads, args.repeats)
        points = [(r.bytes, r.time_us * 1e-6) for r in result.rows]
        nranks = args.nproc_per_node
        source = (f"measured {time.strftime('%Y-%m-%d %H:%M')}, {args.threads} thread(s)/rank, "
                  f"load {result.meta.get('loadavg_at_end')}")
    cal = calibrate.fit(points, nranks, source)
    print(format_calibration(cal))
    out.write_text(json.dumps(cal.to_json(), indent=2) + "\n")
    print(f"# wrote {out}")
    return 0


# -------------------------------------------------------------------------- validate
def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not a comma list of integers") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{what} {text!r} needs positive integers")
    return values


def run_validate(args) -> int:
    from ddpkit.plan import validate
    from ddpkit.plan.calibrate import fit

    cal = _load_calibration(args.calibration) if args.calibration else None
    nproc = cal.nranks if cal else 2
    widths = _int_list(args.widths, "--widths")
    if len(widths) < 2:
        raise ConfigError("--widths needs at least an input and an output width")
    results = []
    cap = "default" if args.bucket_mb is None else f"{args.bucket_mb:g} MiB"
    print(f"# DDP step of an MLP {'-'.join(map(str, widths))} on {nproc} ranks (torch DDP, "
          f"gloo, bucket cap {cap}), median of {args.steps} steps")
    print(f"#{'batch':>6} {'fwd':>7} {'bwd':>7} {'opt':>7} {'comm(pred)':>11} {'buckets':>8} "
          f"{'predicted':>10} {'measured':>10} {'error':>7}")
    for batch in _int_list(args.batch, "--batch"):
        spec = validate.MlpSpec(widths=widths, batch_per_rank=batch, bucket_cap_mb=args.bucket_mb,
                                steps=args.steps, nproc=nproc)
        overlap = validate.default_overlap(spec) if args.overlap == "auto" else float(args.overlap)
        measured = validate.measure(spec)
        used = cal or fit(measured.allreduce_points, nproc, "timed beside the steps")
        pred = validate.predict(measured, used, spec, overlap)
        error = (pred.step_s - measured.step_s) / measured.step_s
        ms = 1e3
        print(f" {batch:>6} {measured.forward_s * ms:>5.1f}ms {measured.backward_s * ms:>5.1f}ms "
              f"{measured.optimizer_s * ms:>5.1f}ms {pred.comm_s * ms:>9.1f}ms "
              f"{len(pred.buckets):>8} {pred.step_s * ms:>8.1f}ms {measured.step_s * ms:>8.1f}ms "
              f"{error:>+7.1%}", flush=True)
        results.append({"batch_per_rank": batch, "overlap": overlap,
                        "calibration": used.to_json(),
                        "predicted_step_s": pred.step_s, "measured_step_s": measured.step_s,
                        "predicted_comm_s": pred.comm_s, "error": error,
                        "measured": measured.__dict__, "buckets": list(pred.buckets)})
    worst = max(abs(r["error"]) for r in results)
    print(f"# overlap {results[0]['overlap']:g}; worst |error| {worst:.1%} (target <= 20%)")
    for r in results:
        c = r["calibration"]
        print(f"# batch {r['batch_per_rank']}: link alpha {c['alpha_s'] * 1e6:.0f} us, "
              f"bandwidth {c['bandwidth_Bps'] / 1e9:.3f} GB/s ({c['source']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"widths": widths, "results": results},
                                             indent=2) + "\n")
        print(f"# wrote {args.out}")
    return 0


# --------------------------------------------------------------------------- project
def _gpu_counts(text: str) -> list[int]:
    from ddpkit.plan.project import powers_of_two

    if ":" in text:
        lo, _, hi = text.partition(":")
        if not (lo.isdigit() and hi.isdigit()):
            raise ConfigError(f"--gpus {text!r}: use MIN:MAX or a comma list")
        return powers_of_two(int(lo), int(hi))
    return list(_int_list(text, "--gpus"))


def _check_project_args(args) -> None:
    """Every value checked before anything is computed, each error naming the option,
    the value and what is allowed."""
    positive = {"--params": args.params, "--grad-bytes": args.grad_bytes,
                "--layers": args.layers, "--tokens-per-gpu": args.tokens_per_gpu,
                "--gpus-per-node": args.gpus_per_node, "--bucket-mb": args.bucket_mb,
                "--param-tensors": args.param_tensors, "--step-ms": args.step_ms,
                "--peak-tflops": args.peak_tflops, "--nics-per-node": args.nics_per_node}
    for option, value in positive.items():
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{option} must be a positive number, got {value:g}")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1] (a fraction of peak), got {args.mfu:g}")
    if not 0 <= args.overlap <= 1:
        raise ConfigError(f"--overlap must be in [0, 1], got {args.overlap:g}")
    if args.spread is not None and not 0 <= args.spread < 1:
        raise ConfigError(f"--spread must be in [0, 1) (e.g. 0.025 for 2.5%), "
                          f"got {args.spread:g}")
    if args.device not in DEVICES:
        raise ConfigError(f"--device {args.device!r} is not one of {', '.join(DEVICES)}")
    for option in ("--intra", "--inter"):
        name = getattr(args, option[2:])
        if name not in PRESETS:
            raise ConfigError(f"{option} {name!r} is not one of {', '.join(PRESETS)}")


def run_project(args) -> int:
    import dataclasses
    import os

    from ddpkit.plan import project
    from ddpkit.plan.model import ALGOS, link

    _check_project_args(args)
    algos = [a.strip() for a in args.algo.split(",") if a.strip()]
    for algo in algos:
        if algo not in ALGOS:
            raise ConfigError(f"--algo {algo!r} is not one of {', '.join(ALGOS)}")
    gpu_counts = _gpu_counts(args.gpus)
    if args.calibration:
        intra = inter = _load_calibration(args.calibration).link()
    else:
        intra, inter = link(args.intra), link(args.inter)
    device = DEVICES[args.device]
    if args.spread is not None:
        device = dataclasses.replace(device, spread=args.spread)
    workload = project.Workload(
        params=args.params, grad_bytes=args.grad_bytes, layers=args.layers,
        tokens_per_gpu=args.tokens_per_gpu, device=device,
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None, mfu=args.mfu,
        step_s=args.step_ms / 1e3 if args.step_ms else None,
        param_tensors=args.param_tensors, bucket_cap_mb=args.bucket_mb)
    rows = project.project(workload, gpu_counts, args.gpus_per_node, intra, inter,
                           algos, args.overlap, args.nics_per_node)
    print(project.projection_table(rows, workload, intra, inter, args.gpus_per_node, args.overlap,
                               args.nics_per_node))
    out_dir = Path(args.out_dir or fresh_dir(os.path.join("runs", "plan")))
    csv_path, png_path = out_dir / "plan.csv", out_dir / "plan.png"
    taken = [p for p in (csv_path, png_path) if p.exists()]
    if taken:
        raise ConfigError(f"--out-dir {out_dir}: {taken[0].name} already exists there; pass "
                          "another --out-dir")
    os.makedirs(out_dir, exist_ok=True)
    with csv_path.open("w") as f:
        f.write("gpus,nodes,algo,allreduce_s,exposed_comm_s,step_s,compute_s,efficiency\n")
        for r in rows:
            p = r.prediction
            f.write(f"{r.gpus},{r.nodes},{r.algo},{p.comm_s:.6g},{p.exposed_comm_s:.6g},"
                    f"{p.step_s:.6g},{p.compute_s:.6g},{p.efficiency:.6g}\n")
    written = [str(csv_path)]
    if not args.no_plot:
        compute = ("measured step" if args.step_ms else f"{args.tokens_per_gpu} tokens/GPU")
        title = (f"{args.params / 1e9:g} B params, {compute}, "
                 f"{intra.name} x {args.gpus_per_node} per node + {inter.name}, "
                 f"overlap {args.overlap:g} (ddpkit plan)")
        serial = project.project(workload, gpu_counts, args.gpus_per_node, intra, inter,
                                 algos, 0.0, args.nics_per_node) if args.overlap > 0 else ()
        project.plot(rows, str(png_path), title, serial)
        written.append(str(png_path))
    print(f"# wrote {', '.join(written)}")
    return 0


def _measure_all_reduce(nproc: int, sizes: str, threads: int | None, repeats: int):
    """Time torch's own all-reduce with the collectives benchmark (an application piece:
    the plan library only fits what it is given)."""
    from ddpkit.bench import collective_timing as bench

    cfg = bench.BenchConfig(op="all_reduce", algos=("backend",),
                            sizes=tuple(bench.parse_sizes(sizes)), nproc=nproc,
                            repeats=repeats, check=False, threads=threads)
    bench.check_config(cfg)
    return bench.run(cfg)
