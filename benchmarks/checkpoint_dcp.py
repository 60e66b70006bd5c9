"""ddpkit's checkpoint against torch's ``dcp.save`` / ``dcp.load`` on the same state.

    .venv/bin/python benchmarks/checkpoint_dcp.py [--model mlp14m] [--repeats 3] [--json F]

One ``ddpkit.spawn`` of 2 gloo ranks builds an MLP (``benchmarks/checkpoint_formats.py``'s
sizes), wraps it in ``DataParallel`` and takes one AdamW step, then ``--repeats`` times,
the two ways taking turns so that load drift hits both alike:

* ddpkit: ``Checkpointer.save(collect_state(model, optimizer))`` (DCP files plus the RNG
  states, a hashed manifest and one rename) and ``load_latest`` + ``restore_state``
  (every file's hash checked, then applied);
* torch:  ``dcp.save({"model": ..., "optim": ...}, checkpoint_id=dir)`` of the module's
  and optimizer's state dicts, and ``dcp.load`` of the same into them, then
  ``load_state_dict``.

The ranks meet at a barrier before and after each call; rank 0's clock. Prints one line
per figure (``save ddpkit 0.123``) and writes the medians and every time to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from checkpoint_formats import MODELS


def _timed(barrier, fn) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def _job(world, directory: str, model_name: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F

    import ddpkit
    from ddpkit.checkpoint import Checkpointer, collect_state, restore_state

    torch.manual_seed(0)
    width, depth = MODELS[model_name]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    ddp = ddpkit.DataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    x, y = torch.randn(4, width), torch.randint(0, width, (4,))
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
    ours = Checkpointer(str(Path(directory, "ddpkit")), keep=1)
    theirs = Path(directory, "torch")
    times: dict[str, list[float]] = {k: [] for k in
                                     ("save ddpkit", "save torch", "load ddpkit", "load torch")}

    def ddpkit_save(step: int) -> None:
        ours.save(collect_state(model=ddp, optimizer=opt, step=step), step)

    def ddpkit_load() -> None:
        restore_state(ours.load_latest(), model=ddp, optimizer=opt)

    def torch_save(step: int) -> None:
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=str(theirs / f"step_{step}"))

    def torch_load(step: int) -> None:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=str(theirs / f"step_{step}"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    for r in range(repeats):
        step = r + 1
        order = ("ddpkit", "torch") if r % 2 == 0 else ("torch", "ddpkit")
        for who in order:
            save = partial(ddpkit_save if who == "ddpkit" else torch_save, step)
            times[f"save {who}"].append(_timed(dist.barrier, save))
        for who in order:
            load = ddpkit_load if who == "ddpkit" else partial(torch_load, step)
            times[f"load {who}"].append(_timed(dist.barrier, load))
    params = sum(p.numel() for p in model.parameters())
    return {"medians_s": {k: statistics.median(v) for k, v in times.items()},
            "times_s": times, "params": params}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mlp14m")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads of each way")
    p.add_argument("--json", default=None, help="also write the medians here")
    args = p.parse_args(argv)
    import ddpkit

    with tempfile.TemporaryDirectory(prefix="ddpkit-ckpt-dcp-") as directory:
        out = ddpkit.spawn(_job, 2, args=(directory, args.model, args.repeats))[0]
    print(f"{args.model} ({out['params'] / 1e6:.1f}M parameters) + AdamW, 2 gloo ranks, "
          f"median of {args.repeats}")
    for name, seconds in out["medians_s"].items():
        print(f"{name} {seconds:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, **out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
