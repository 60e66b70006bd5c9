"""The trainer's state besides what :class:`ddpkit.Run` owns (step, epoch, data
position) and model and optimizer: the records of the finished epochs and the running
metric sums of the epoch in progress, both checkpointed with the run; and the checks
that nothing non-finite is ever saved as good (:mod:`ddpkit.train.divergence`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint.model_state import unwrap
from ddpkit.train import divergence
from ddpkit.train.metrics import MetricSums

# The trainer these act for (a ddpkit.train.trainer.Trainer, which imports this module).
Trainer = Any


class EpochHistory:
    """The record of every finished epoch (train and test metrics): the run's summary
    and curves. Checkpointed with the run (its count says which epoch is next)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    @property
    def epochs(self) -> int:
        """Epochs trained and evaluated."""
        return len(self.records)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epochs, "history": list(self.records)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (Checkpoints written before the run counted alone also hold its step and data
        # position here; the run restores those from its own state.)
        self.records = list(state["history"])


class EpochSums:
    """The epoch's running metric sums of every rank, for a checkpoint taken mid-epoch."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.resumed: MetricSums | None = None  # loaded, until the epoch takes them

    def take_resumed(self) -> MetricSums | None:
        """The sums a resume loaded, once: the epoch in progress continues from them."""
        sums, self.resumed = self.resumed, None
        return sums

    def state_dict(self) -> list[list[float]]:
        t = self.trainer  # a collective: the run saves on every rank
        sums = gather_lists(t._sums.values() if t._sums else [0.0, 0.0, 0.0], t.device)
        refuse_non_finite_state(t, sums)  # nothing non-finite is ever saved as good
        return sums

    def load_state_dict(self, sums: list[list[float]]) -> None:
        t = self.trainer
        if len(sums) == t.world.world_size:
            mine = sums[t.world.rank]
        else:  # other world size: the epoch's job-wide totals stay exact on rank 0
            mine = [sum(col) for col in zip(*sums)] if t.world.is_main and sums else [0.0] * 3
        self.resumed = MetricSums.from_values(list(mine), t.device)


def gather_lists(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's short list of floats, by rank (a collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def refuse_non_finite_record(trainer: Trainer, record: dict[str, Any]) -> None:
    """End the run at an epoch's end whose reduced loss is not finite (every rank sees
    the same reduced numbers, so every rank stops here)."""
    for split in ("train", "test"):
        loss = record.get(f"{split}_loss")
        if record.get(f"{split}_samples") and divergence.first_bad([loss]) is not None:
            raise _diverged(trainer, f"the {split} loss is {loss}")


def refuse_non_finite_state(trainer: Trainer, rank_sums: list[list[float]]) -> None:
    """Before a checkpoint: every rank's running sums of this epoch (``rank_sums``,
    the same list on every rank) and the weights (equal on every rank) must be finite,
    or the run ends without writing it."""
    for rank, sums in enumerate(rank_sums):
        bad = divergence.first_bad(sums[:1])
        if bad is not None:
            raise _diverged(trainer, f"the training loss on rank {rank} is {bad}")
    if trainer.sharded:  # every rank's updated shards into the module (collective)
        trainer.model.gather_parameters()
    if not divergence.weights_finite(unwrap(trainer.model).parameters()):
        raise _diverged(trainer, "the weights are no longer finite")


def _diverged(trainer: Trainer, what: str) -> divergence.DivergedError:
    last = trainer.checkpointer.checkpoints() if trainer.checkpointer is not None else []
    return divergence.diverged(what, trainer.run.step, trainer.history.epochs + 1,
                               str(last[-1].path) if last else None, trainer.cfg.optim.lr)
