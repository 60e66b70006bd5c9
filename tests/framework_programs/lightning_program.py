"""A Lightning script, as its users write it (no ddpkit in it):
``Trainer(accelerator="cpu", devices=2, strategy="ddp")``, ``self.log(...,
sync_dist=True)``, ``trainer.save_checkpoint``.

    python lightning_program.py --out DIR                             (Lightning starts rank 1)
    torchrun --nproc-per-node 2 lightning_program.py --out DIR        (torch's DDP)
    ddpkit launch --nproc-per-node 2 lightning_program.py --out DIR   (ddpkit's)
"""

import argparse
import os

import framework_record
import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, fail_rank: int | None = None):
        super().__init__()
        self.net = framework_record.mlp()
        self.fail_rank = fail_rank
        self.clock = framework_record.StepClock()
        self.engine: dict = {}

    def on_train_start(self):
        self.engine = framework_record.engine_of(self.trainer.strategy.model)

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and batch_idx == 2:
            raise RuntimeError(f"training_step failed on purpose at batch {batch_idx}")
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.clock.tick()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--all-reduce-calls", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=None)
    args = p.parse_args()

    L.seed_everything(0)
    model = Classifier(args.fail_rank)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader)
    wrapped = trainer.strategy.model  # after fit: unwrapped again by the strategy's teardown
    trainer.save_checkpoint(os.path.join(args.out, "model.ckpt"))
    framework_record.write(args.out, {
        "engine": model.engine, "after_fit_is_module": wrapped is model,
        "train_loss_epoch": trainer.callback_metrics["train_loss_epoch"].item(),
        "step_s": model.clock.times,
        "all_reduce_1k_s": framework_record.small_all_reduce_s(args.all_reduce_calls)})


if __name__ == "__main__":
    main()
