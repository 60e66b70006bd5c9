"""A Hugging Face transformers ``Trainer`` script, as its users write it (no ddpkit in
it): a 2-layer BERT for sequence classification built from a config (no download),
trained on synthetic tokens, saved with ``trainer.save_model``.

    torchrun --nproc-per-node 2 trainer_program.py --out DIR       (torch's DDP)
    ddpkit launch --nproc-per-node 2 trainer_program.py --out DIR  (ddpkit's)
"""

import argparse
import os

import framework_record
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

SEQ = 16


def make_config() -> BertConfig:
    return BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=128,
                      max_position_embeddings=SEQ, num_labels=2)


class Tokens(torch.utils.data.Dataset):
    """Synthetic sentences: label 1 when token 7 occurs more often than token 9."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 128, (n, SEQ), generator=g)
        self.labels = ((self.ids == 7).sum(1) > (self.ids == 9).sum(1)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


class Clock(TrainerCallback):
    def __init__(self, fail_rank: int | None):
        self.clock = framework_record.StepClock()
        self.fail_rank = fail_rank

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.tick()
        if self.fail_rank == args.process_index and state.global_step >= 2:
            raise RuntimeError(f"a callback failed on purpose at step {state.global_step}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--all-reduce-calls", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=None)
    args = p.parse_args()

    set_seed(0)
    model = BertForSequenceClassification(make_config())
    training = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"), per_device_train_batch_size=8,
        max_steps=args.steps, learning_rate=1e-3, logging_steps=4, save_strategy="no",
        report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0)
    clock = Clock(args.fail_rank)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(512),
                      callbacks=[clock])
    result = trainer.train()
    trainer.save_model(os.path.join(args.out, "model"))
    framework_record.write(args.out, {
        "engine": framework_record.engine_of(trainer.model_wrapped),
        "unwrapped_is_model": trainer.accelerator.unwrap_model(trainer.model_wrapped)
        is model, "train_loss": result.training_loss,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "step_s": clock.clock.times,
        "all_reduce_1k_s": framework_record.small_all_reduce_s(args.all_reduce_calls),
        "all_gather_1_s": framework_record.one_number_all_gather_s(args.all_reduce_calls)})


if __name__ == "__main__":
    main()
