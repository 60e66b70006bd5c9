"""The GPU check's models and their batches: the 8.4M-parameter MLP of
benchmarks/ddp_step.py, a small transformer, and an MLP with dropout, each at full size
on CUDA and tiny in the CPU rehearsal."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import make_mlp  # noqa: E402  (the 8.4M-parameter benchmark MLP)
from gpu_check_lib import Setup  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    """A small decoder-only transformer (token and position embeddings, pre-norm blocks
    with causal attention, an untied head)."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@dataclass(frozen=True)
class Task:
    """A model and the batches it trains on: ``batch(step, rank, world_size)`` is rank
    ``rank``'s strided share of step ``step``'s global batch (ShardSampler's layout), so
    every world size trains on the same global batches."""

    name: str
    build: Callable[[], nn.Module]
    global_batch: int
    make_inputs: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]

    def batch(self, step: int, rank: int, world_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 + step)
        x, y = self.make_inputs(g, self.global_batch)
        return x[rank::world_size].to(device), y[rank::world_size].to(device)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_task(key: str, setup: Setup) -> Task:
    """``"mlp"`` (the 8.4M-parameter MLP), ``"gpt"`` (a small transformer) or ``"dropout"``
    (an MLP with dropout: exact mode's per-slice random streams decide its masks); tiny
    versions in the rehearsal. (Ranks get the key: a Task holds functions, which do not
    pickle.)"""
    if key == "mlp":
        sizes = setup.size((1024, 2048, 2048, 1024, 10), (32, 48, 48, 10))

        def inputs(g, n):
            return (torch.randn(n, sizes[0], generator=g),
                    torch.randint(0, sizes[-1], (n,), generator=g))

        return Task(setup.size("mlp8m", "mlp (tiny)"), lambda: make_mlp(sizes),
                    setup.size(128, 16), inputs)
    if key == "gpt":
        vocab, width, depth, heads, context = setup.size((8192, 512, 6, 8, 256),
                                                         (64, 32, 2, 4, 16))

        def tokens(g, n):
            t = torch.randint(0, vocab, (n, context + 1), generator=g)
            return t[:, :-1].contiguous(), t[:, 1:].contiguous()

        return Task(setup.size("transformer", "transformer (tiny)"),
                    lambda: TinyGPT(vocab, width, depth, heads, context), setup.size(32, 4),
                    tokens)
    if key == "dropout":
        width = setup.size(512, 24)

        def build():
            return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(width, 10))

        def features(g, n):
            return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)

        return Task("mlp with dropout", build, 64, features)
    raise ValueError(f"unknown task {key!r}")


def parameter_count(task: Task) -> int:
    return sum(p.numel() for p in task.build().parameters())
