"""Coming from an Accelerate-style script: the same loop in plain torch + ddpkit.

A script written the HF Accelerate way (``Accelerator()``, ``prepare(model, optimizer,
dataloader)``, ``accelerator.accumulate``, ``accelerator.backward(loss)``,
``gather_for_metrics`` for evaluation) does four things for you; here each is one
visible line (docs/migrating.md has the table, Accelerate is not needed):

* the process group and this rank's device:  ``with ddpkit.distributed() as world``;
* the model:        ``ddpkit.DataParallel(model.to(world.device))``;
* the dataloader:   a ``ShardSampler`` that gives each rank its share of a *global* batch
  (the optimizer needs nothing: DataParallel averages the gradients);
* the metrics:      ``gather_for_metrics`` below, an all-gather that puts predictions back
  in sample order and drops the padding that keeps the last batch even on every rank.

``accelerator.backward(loss)`` is ``loss.backward()``; ``accelerator.accumulate(model)``
is ``model.no_sync()`` on the micro-batches that do not step.

Run:  ddpkit launch --nproc-per-node 2 examples/62_from_accelerate_style.py [--save out.pt]
"""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit
from ddpkit.data import ShardSampler


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()  # 4 classes
    return TensorDataset(x, y)


def gather_for_metrics(t: torch.Tensor, world: ddpkit.World) -> torch.Tensor:
    """Every rank's ``t`` (one row per sample of its local batch), in sample order.

    A ShardSampler hands rank r the positions start+r, start+r+W, ... of each global
    batch, so interleaving the gathered rows restores the order; the last batch's
    padding ends up at the very end, where the caller cuts it off.
    """
    out = torch.empty((world.world_size, *t.shape), dtype=t.dtype, device=t.device)
    ddpkit.comm.all_gather(out, t.contiguous())
    return out.transpose(0, 1).reshape(-1, *t.shape[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--save", default=None, help="rank 0 writes model + eval predictions")
    args = parser.parse_args()

    with ddpkit.distributed() as world:  # accelerator = Accelerator()
        device = torch.device(world.device)  # accelerator.device
        train_set, eval_set = make_data(640, seed=0), make_data(101, seed=1)

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # model, optimizer, train_dl, eval_dl = accelerator.prepare(...)
        model = ddpkit.DataParallel(model.to(device))
        micro = args.global_batch // args.accumulate
        train_sampler = ShardSampler(train_set, global_batch_size=micro, seed=0)
        train_dl = DataLoader(train_set, sampler=train_sampler,
                              batch_size=train_sampler.local_batch_size)
        eval_sampler = ShardSampler(eval_set, global_batch_size=32, shuffle=False)
        eval_dl = DataLoader(eval_set, sampler=eval_sampler,
                             batch_size=eval_sampler.local_batch_size)

        for epoch in range(args.epochs):
            model.train()
            for i, (x, y) in enumerate(train_dl):
                x, y = x.to(device), y.to(device)
                steps = (i + 1) % args.accumulate == 0
                with contextlib.nullcontext() if steps else model.no_sync():  # accumulate
                    loss = F.cross_entropy(model(x), y) / args.accumulate
                    loss.backward()  # accelerator.backward(loss)
                if steps:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()

            model.eval()
            predictions, references = [], []
            with torch.no_grad():
                for x, y in eval_dl:
                    pred = model(x.to(device)).argmax(-1)
                    predictions.append(gather_for_metrics(pred, world))
                    references.append(gather_for_metrics(y.to(device), world))
            predictions = torch.cat(predictions)[: len(eval_set)]  # drop the padding
            references = torch.cat(references)[: len(eval_set)]
            accuracy = (predictions == references).float().mean().item()
            if world.is_main:  # accelerator.print
                print(f"epoch {epoch}: eval accuracy {accuracy:.4f} on {len(references)} "
                      f"samples", flush=True)

        if world.is_main and args.save:  # accelerator.save(accelerator.unwrap_model(model))
            torch.save({"model": model.module.state_dict(), "predictions": predictions,
                        "references": references}, args.save)


if __name__ == "__main__":
    main()
