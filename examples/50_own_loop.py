"""Your own training loop, with resume, preemption and hang detection from ddpkit.Run.

A small character-level GPT (written below) learns Python from the standard library's
own sources, which every machine with Python has. The loop is plain PyTorch: AdamW,
linear warm-up then cosine learning rate, bf16 autocast, gradient accumulation with
no_sync, clip_grad_norm_, a DataLoader with worker processes over a ShardSampler.
``ddpkit.Run`` adds what a long job needs, in the lines marked ``# Run``:

* it resumes from the newest checkpoint in --run-dir (model, optimizer, LR schedule,
  data position mid-epoch, every rank's random streams), so a restarted or requeued
  job ends with the parameters of an uninterrupted run, bit for bit;
* SIGTERM/SIGUSR1 on any rank stops every rank at the same step with a checkpoint;
* a rank that stops arriving is named (--collective-timeout) instead of a silent hang;
* every --log-every steps rank 0 appends loss, grad norm and lr to metrics.jsonl.

Run:  ddpkit launch --nproc-per-node 2 examples/50_own_loop.py --run-dir runs/gpt
      (the same line again continues the run; --max-restarts 3 survives a dead worker)
"""

import argparse
import contextlib
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import ddpkit
from ddpkit.data import ShardSampler

VOCAB = 256  # bytes: every character of the text is one or more tokens


def stdlib_text(num_bytes: int) -> bytes:
    """The first ``num_bytes`` of the standard library's modules, in name order."""
    chunks, have = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        chunks.append(path.read_bytes())
        have += len(chunks[-1])
        if have >= num_bytes:
            break
    return b"".join(chunks)[:num_bytes]


class TextBlocks(Dataset):
    """Non-overlapping blocks of ``block + 1`` bytes: input is the block, target the
    same block shifted by one."""

    def __init__(self, text: bytes, block: int):
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.blocks = data[: len(data) // (block + 1) * (block + 1)].view(-1, block + 1)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.blocks[i, :-1], self.blocks[i, 1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, block: int, dim: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(block, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(dim, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings
        for m in self.modules():  # small initial weights: the first loss is about ln(256)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.drop(self.tok(idx) + self.pos(pos)))))


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
    return factor


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="checkpoints, metrics.jsonl, model.pt")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=512, help="text blocks in the data set")
    p.add_argument("--block", type=int, default=32, help="context length in bytes")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=16, help="global batch per micro-step")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=4, help="warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--log-with", default="", help="also: csv, tensorboard (comma-separated)")
    p.add_argument("--collective-timeout", type=float, default=None)
    p.add_argument("--log-sample-ids", action="store_true", help="for audits and tests")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with ddpkit.distributed() as world:
        device = torch.device(world.device)
        data = TextBlocks(stdlib_text(args.samples * (args.block + 1)), args.block)
        sampler = ShardSampler(data, global_batch_size=args.batch_size, seed=args.seed,
                               drop_last=True)
        micro_steps = sampler.num_batches()
        if micro_steps % args.grad_accum:
            raise SystemExit(f"50_own_loop: error: {micro_steps} micro-steps per epoch do not "
                             f"divide into --grad-accum {args.grad_accum}; change either")
        loader = DataLoader(data, sampler=sampler, batch_size=sampler.local_batch_size,
                            num_workers=args.workers, persistent_workers=args.workers > 0)

        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = GPT(args.block, args.dim, args.layers, args.heads, args.dropout).to(device)
        ddp_model = ddpkit.DataParallel(model)
        torch.manual_seed(args.seed + 1 + world.rank)  # dropout masks differ between ranks
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        total_steps = args.epochs * micro_steps // args.grad_accum
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                      warmup_cosine(args.warmup, total_steps))

        fixed = {k: v for k, v in vars(args).items()  # what a resume must not change
                 if k not in ("run_dir", "workers", "threads", "log_every", "log_with",
                              "collective_timeout", "log_sample_ids", "checkpoint_every")}
        run = ddpkit.Run(args.run_dir, model=ddp_model, optimizer=optimizer,  # Run
                         scheduler=scheduler, sampler=sampler, config=fixed,  # Run
                         every_steps=args.checkpoint_every, log_every=args.log_every,  # Run
                         log_with=args.log_with.split(","), log_sample_ids=args.log_sample_ids,
                         collective_timeout=args.collective_timeout)  # Run
        with run:  # Run
            for _epoch in run.epochs(args.epochs):  # Run
                loss_sum = torch.zeros((), device=device)
                for i, (x, y) in enumerate(run.batches(loader)):  # Run
                    x, y = x.to(device), y.to(device)
                    last = (i + 1) % args.grad_accum == 0
                    # Only the last micro-step of an optimizer step reduces gradients.
                    with contextlib.nullcontext() if last else ddp_model.no_sync():
                        with torch.autocast(device.type, dtype=torch.bfloat16):
                            logits = ddp_model(x)
                        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))
                        (loss / args.grad_accum).backward()
                    loss_sum += loss.detach()
                    if not last:
                        continue
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    run.step_done(loss=loss_sum / args.grad_accum, grad_norm=norm)  # Run
                    loss_sum.zero_()

        if run.preempted:  # Run: every rank stopped at the same step, with a checkpoint
            print(f"rank {world.rank}: stopped at step {run.step}; the same command continues")
            return
        if world.is_main:
            torch.save(model.state_dict(), Path(args.run_dir) / "model.pt")
            print(f"done: {run.step} steps (this attempt from step {run.start_step}); "
                  f"model in {args.run_dir}/model.pt, metrics in {args.run_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
