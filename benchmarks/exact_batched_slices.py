"""A rank's exact-mode slices computed in one batched call: what it would save, and its bits.

Exact mode runs a rank's V/W slices one after another, each its own forward and
backward (the "floor" of benchmarks/exact_step.py). On a small model that loop is
Python and dispatch overhead, so the question of issue 34 is whether one call for all
of a rank's slices (``torch.func.vmap`` over the slice dimension of ``grad`` of the
loss) could replace it. Per variant, one process, 1 thread (as exact mode pins it):

* ``loop``: the slices one after another, forward + backward each (today's slice work);
* ``one batch``: the same rows as one batch (the default mode's compute, no slices);
* ``vmap``: ``vmap(grad(loss))`` over the slices, eager;
* ``vmap, aot_eager`` / ``vmap, inductor``: the same under ``torch.compile`` with
  that backend (aot_eager: the traced graph run on eager kernels; inductor: generated
  code).

For each vmap variant: whether every slice's gradients equal the loop's bit for bit,
and whether they equal those of a call on twice the slices (the rank's slices then
the same again reversed: the same slice computed in a batch of another size, as at
another world size). Times: the median of ``--repeats`` calls, per call (all of the
rank's slices).

Run:  python benchmarks/exact_batched_slices.py [--rows 16 --slices 4 --repeats 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="64,128,10", help="the MLP's widths (main job's: 64,128,10)")
    p.add_argument("--rows", type=int, default=16, help="rows per slice (main job: 128 / V=8)")
    p.add_argument("--slices", type=int, default=4, help="slices per rank (V/W: 8/2)")
    p.add_argument("--repeats", type=int, default=300)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sizes = [int(s) for s in args.sizes.split(",")]
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    params = {k: v.detach() for k, v in model.named_parameters()}
    s, r = args.slices, args.rows
    x = torch.randn(s * r, sizes[0])
    y = torch.randint(0, sizes[-1], (s * r,))

    def loss(p, xs, ys):
        return F.cross_entropy(functional_call(model, p, (xs,)), ys)

    per_slice = vmap(grad(loss), in_dims=(None, 0, 0), randomness="error")

    def loop():
        grads = []
        for k in range(s):
            F.cross_entropy(model(x[k * r:(k + 1) * r].contiguous()),
                            y[k * r:(k + 1) * r].contiguous()).backward()
            grads.append({n: q.grad for n, q in model.named_parameters()})
            for q in model.parameters():
                q.grad = None
        return grads

    def one_batch():
        F.cross_entropy(model(x), y).backward()
        for q in model.parameters():
            q.grad = None

    def batched(fn, count):
        xs = x.view(s, r, -1)
        ys = y.view(s, r)
        if count == 2 * s:
            xs, ys = torch.cat([xs, xs.flip(0)]), torch.cat([ys, ys.flip(0)])
        return lambda: fn(params, xs, ys)

    reference = loop()
    variants = {"loop": loop, "one batch": one_batch}
    checks = {}
    for name, backend in [("vmap", None), ("vmap, aot_eager", "aot_eager"),
                          ("vmap, inductor", "inductor")]:
        fn, fn2 = per_slice, per_slice
        if backend is not None:
            torch._dynamo.reset()
            fn = torch.compile(per_slice, backend=backend, dynamic=False)
            fn2 = torch.compile(per_slice, backend=backend, dynamic=False)
        start = time.perf_counter()
        got = batched(fn, s)()
        first = time.perf_counter() - start
        twice = batched(fn2, 2 * s)()
        same_as_loop = all(torch.equal(got[n][k], reference[k][n])
                           for n in params for k in range(s))
        batch_free = all(torch.equal(got[n], twice[n][:s]) for n in params)
        checks[name] = (same_as_loop, batch_free, first)
        variants[name] = batched(fn, s)
    times = {}
    for name, fn in variants.items():
        for _ in range(20):
            fn()
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples) * 1e6
    print(f"MLP {sizes}, {s} slices of {r} rows, 1 thread; median us per call over "
          f"{args.repeats}")
    print(f"{'variant':<18}{'us':>9}{'x loop':>8}  same bits as loop  same bits at 2x slices"
          "  first call s")
    for name, us in times.items():
        same, free, first = checks.get(name, (None, None, None))
        extra = "" if same is None else f"  {str(same):<17}  {str(free):<21}  {first:.1f}"
        print(f"{name:<18}{us:>9.1f}{us / times['loop']:>8.2f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
