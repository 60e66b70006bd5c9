"""How far exact mode's gradient mean is from the true mean, next to the plain float32 sum.

Trains the main job (``ddpkit train --exact`` defaults: digits, MLP, global batch
``--batch-size``) on one process for ``--epochs`` and, at every step, compares three
means of the same V per-slice float32 gradients with the float64 mean of those float32
terms (exact to 2^-53, the reference):

* ``exact, int32``   - exact mode's result in the int32 format (``ExactMean32``; the
  default on large models, asked for here with ``DDPKIT_EXACT_SUM=int32``, so the run
  trains with it);
* ``exact, float64`` - the float64 format's result on the same terms (``ExactMean``);
* ``exact, gather`` - the gather format's on the same terms (``ExactMeanGather``; the
  main job's default);
* ``float32`` - ``sum(rows) / V`` in float32, in slice order (one process's plain sum);
* ``float32, pairs`` - the same sum grouped as 2 ranks would (even and odd slices).

Reported: the largest absolute difference over all elements and steps, and the largest
difference relative to ``max_k |g_k|`` per element (the scale of the terms); and how
often and how far the two formats' results differ from each other.

Run:  python benchmarks/exact_accuracy.py [--epochs 3 --batch-size 96]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import ddpkit
from ddpkit.parallel.exact.exact_gather import ExactMeanGather
from ddpkit.parallel.exact.exact_sum import ExactMean
from ddpkit.parallel.exact.exact_sum32 import FORMAT_ENV, ExactMean32


def worker(world, batch_size: int, epochs: int) -> dict:
    from ddpkit.train.config import Config
    from ddpkit.train.trainer import Trainer

    os.environ[FORMAT_ENV] = "int32"  # the hooked format (the main job's default is gather)
    worst = {name: [0.0, 0.0] for name in ("exact, int32", "exact, float64", "exact, gather",
                                           "float32", "float32, pairs")}
    formats = {"elements": 0, "differ": 0, "max ulp": 0, "max scaled": 0.0}
    original = ExactMean32.mean

    def measured(self, slots, out, **kwargs):
        result = original(self, slots, out, **kwargs)
        if not isinstance(slots, torch.Tensor):  # per segment, its terms: as [rows, n]
            columns = []
            for column, size in zip(slots, self.segments, strict=True):
                terms = list(column)  # rows of a stacked one, or the 1-D terms
                terms += [torch.zeros(size)] * (self.rows - len(terms))  # missing: zeros
                columns.append(torch.stack(terms))
            slots = torch.cat(columns, dim=1)
        terms = slots.double()
        truth = terms.sum(0) / self.terms
        scale = terms.abs().amax(0).clamp_min(1e-300)
        wide = ExactMean(self.terms, self.n, self.terms).mean(slots, torch.empty(self.n))
        apart = (result.view(torch.int32).long() - wide.view(torch.int32).long()).abs()
        formats["elements"] += self.n
        formats["differ"] += int((apart != 0).sum())
        formats["max ulp"] = max(formats["max ulp"], int(apart.max()))
        formats["max scaled"] = max(formats["max scaled"], float(
            ((result.double() - wide.double()).abs() / scale).max()))
        gathered = ExactMeanGather(self.terms, self.n, self.terms).mean(
            slots, torch.empty(self.n))
        means = {"exact, int32": result.double(), "exact, float64": wide.double(),
                 "exact, gather": gathered.double(),
                 "float32": (slots.sum(0) / self.terms).double(),
                 "float32, pairs": ((slots[0::2].sum(0) + slots[1::2].sum(0))
                                    / self.terms).double()}
        for name, mean in means.items():
            err = (mean - truth).abs()
            worst[name][0] = max(worst[name][0], err.max().item())
            worst[name][1] = max(worst[name][1], (err / scale).max().item())
        return result

    ExactMean32.mean = measured
    cfg = Config.from_dict({"train": {"batch_size": batch_size, "exact": True,
                                      "epochs": epochs, "progress": False}})
    trainer = Trainer(cfg, world, write=False)
    for _ in range(epochs):
        trainer.train_epoch()  # the epoch the run is in, then the next
    return {"steps": trainer.run.step, "slices": cfg.slice_count(),
            "worst": worst, "formats": formats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)
    (result,) = ddpkit.spawn(worker, nprocs=1, args=(args.batch_size, args.epochs))
    print(f"main job, exact mode, {result['slices']} slices, "
          f"{result['steps']} steps: per-step gradient mean vs the float64 mean")
    print(f"{'mean':16}{'max |diff|':>14}{'max |diff| / max_k |g_k|':>28}")
    for name, (absolute, relative) in result["worst"].items():
        print(f"{name:16}{absolute:14.3e}{relative:28.3e}")
    f = result["formats"]
    print(f"int32 vs float64 format: {f['differ']} of {f['elements']} elements differ "
          f"({f['differ'] / max(f['elements'], 1):.2e}), by at most {f['max ulp']} "
          f"float32 ulp of the result, {f['max scaled']:.3e} of max_k |g_k|")
    return 0


if __name__ == "__main__":
    sys.exit(main())
