"""A Hugging Face Accelerate training script, as its users write it (no ddpkit in it):
``Accelerator().prepare(model, optimizer, loader)``, gradient accumulation,
``accelerator.backward``, ``reduce``, ``wait_for_everyone``, ``unwrap_model``, ``save``.

    torchrun --nproc-per-node 2 accelerate_program.py --out DIR       (torch's DDP)
    ddpkit launch --nproc-per-node 2 accelerate_program.py --out DIR  (ddpkit's)
"""

import argparse
import os

import framework_record
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class FailingForward(nn.Module):
    """The model, whose forward raises on one rank at one step (a failure inside the
    framework's wrapped model)."""

    def __init__(self, net: nn.Module, rank: int, step: int):
        super().__init__()
        self.net, self.rank, self.step, self.calls = net, rank, step, 0

    def forward(self, x):
        self.calls += 1
        if int(os.environ.get("RANK", 0)) == self.rank and self.calls > self.step:
            raise RuntimeError(f"forward failed on purpose at call {self.calls}")
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--all-reduce-calls", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=None)
    args = p.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    model = framework_record.mlp()
    if args.fail_rank is not None:
        model = FailingForward(model, args.fail_rank, step=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    clock, losses = framework_record.StepClock(), []
    for _ in range(args.epochs):
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            clock.tick()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save(accelerator.unwrap_model(model).state_dict(),
                         os.path.join(args.out, "model.pt"))
    framework_record.write(args.out, {
        "engine": framework_record.engine_of(model), "losses": losses,
        "step_s": clock.times,
        "all_reduce_1k_s": framework_record.small_all_reduce_s(args.all_reduce_calls)})
    accelerator.end_training()


if __name__ == "__main__":
    main()
