"""What checkpointing costs the main job, and how long one save / restore takes.

    .venv/bin/python benchmarks/checkpoint.py [--rounds 3] [--json out.json]
    .venv/bin/python benchmarks/checkpoint.py --formats --old-src DIR/src   # format 1 vs DCP

``--formats``: save and load time and size of the 200M-parameter model's checkpoint in
format 1 against DCP, side by side (``benchmarks/checkpoint_formats.py``). Without it:

Runs the README's main job (digits, MLP, 20 epochs, global batch 128) on 2 gloo ranks
(TCPStore, as under torchrun) in one ``ddpkit.spawn``, once per variant per round,
variants interleaved so load drift hits them alike:

* ``off``          ``--no-checkpoints``: no per-step agreement, no saves;
* ``epoch``        the default: one checkpoint per epoch (20) + the per-step all-reduce
                   that agrees on stop/save;
* ``every 10``     ``--checkpoint-every-steps 10`` on top (44 saves);
* ``every step``   ``--checkpoint-every-steps 1`` (240 saves): the worst case.

The figure is the training loop's time (``summary.train_time_s``: steps, evaluation,
checkpoints; not process start-up or the final plot), median over rounds. Then, on the
trained model and on a 4.3M-parameter MLP (hidden 2048 x 2048), the median time of
``Trainer.save_checkpoint()`` and ``Trainer.restore()`` (verify + load + apply, rank 0's
clock).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ddpkit
from ddpkit.train.config import resolve

VARIANTS = {
    "off": {"checkpoints": False},
    "epoch": {},
    "every 10": {"checkpoint_every_steps": 10},
    "every step": {"checkpoint_every_steps": 1},
}


def _config(**overrides):
    return resolve({"threads": 1, "progress": False, **overrides})


def _timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _bench(world, rounds: int, directory: str):
    import logging

    from ddpkit.train.trainer import Trainer

    logging.getLogger("ddpkit").setLevel(logging.WARNING)
    loop: dict[str, list[float]] = {name: [] for name in VARIANTS}
    saves: dict[str, int] = {}
    for r in range(rounds):
        for name, overrides in VARIANTS.items():
            trainer = Trainer(_config(**overrides), world,
                              run_dir=Path(directory) / f"{name.replace(' ', '-')}-{r}")
            count = [0]
            if trainer.checkpointer is not None:
                save = trainer.checkpointer.save

                def counted(*a, save=save, count=count, **k):
                    count[0] += 1
                    return save(*a, **k)

                trainer.checkpointer.save = counted
            loop[name].append(trainer.fit()["train_time_s"])
            saves[name] = count[0]
    io = {}
    for label, hidden in (("main job MLP (9.6k params)", [128]),
                          ("MLP 2048x2048 (4.3M params)", [2048, 2048])):
        trainer = Trainer(_config(hidden=hidden, epochs=1), world,
                          run_dir=Path(directory) / f"io-{hidden[0]}")
        trainer.fit()
        path = trainer.save_checkpoint()  # collective: every rank calls it
        size = path.stat().st_size if world.is_main else 0
        io[label] = {
            "MiB": size / 2**20,
            "save_s": _timed(trainer.save_checkpoint, 5),
            "restore_s": _timed(trainer.restore, 5),
        }
    return {"loop_s": loop, "saves": saves, "io": io}


def main() -> None:
    if "--formats" in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from checkpoint_formats import main as formats

        formats([a for a in sys.argv[1:] if a != "--formats"])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        results = ddpkit.spawn(_bench, 2, args=(args.rounds, directory), rendezvous="env")
    res = results[0]
    base = statistics.median(res["loop_s"]["off"])
    print(f"main job, 2 ranks, training loop time, median of {args.rounds} rounds")
    print(f"{'variant':<12} {'saves':>6} {'loop s':>8} {'overhead':>9}")
    for name, samples in res["loop_s"].items():
        med = statistics.median(samples)
        print(f"{name:<12} {res['saves'][name]:>6} {med:>8.2f} {100 * (med / base - 1):>8.1f}%")
    print(f"\n{'model':<30} {'MiB':>6} {'save ms':>8} {'restore ms':>11}")
    for label, row in res["io"].items():
        print(f"{label:<30} {row['MiB']:>6.1f} {1e3 * row['save_s']:>8.1f} "
              f"{1e3 * row['restore_s']:>11.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
