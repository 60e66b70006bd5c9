"""A :class:`ddpkit.Run`'s checkpoints: what it saves, how it resumes, and the logs
cut back to the step it resumed at. Run inherits this; it owns the state saved
(step, epoch, data position) and everything else of the run.

A checkpoint holds, besides model, optimizer, scheduler and the sampler's state at the
position the loop reached, the run's own record (``extra["run"]``: step, epoch,
position under the format name below) and every ``state=`` object's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint import CheckpointError, collect_state, config_fingerprint, restore_state
from ddpkit.errors import ConfigError
from ddpkit.fault import set_collective_timeout
from ddpkit.log import get_logger
from ddpkit.loop.metrics_log import truncate_records
from ddpkit.loop.sample_ids import truncate_sample_logs
from ddpkit.runtime.process_group import DEFAULT_TIMEOUT

log = get_logger("ddpkit.loop.run")

FORMAT = "ddpkit-run/1"


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class RunCheckpoints:
    """Saving and resuming, for :class:`ddpkit.Run` (which sets every attribute used
    here in its ``__init__``)."""

    @contextlib.contextmanager
    def _patient(self) -> Iterator[None]:
        """Checkpoint I/O may outlast a tight collective timeout: relax it meanwhile."""
        short = self.collective_timeout
        if short is None or not _initialized():
            yield
            return
        set_collective_timeout(max(short, DEFAULT_TIMEOUT.total_seconds()))
        try:
            yield
        finally:
            set_collective_timeout(short)

    # ------------------------------------------------------------------ resume
    def restore(self, *, required: bool = False) -> dict[str, Any] | None:
        """Collective: continue from the newest good checkpoint now (entering the run
        does this by itself unless ``resume=False``). Returns what
        :func:`ddpkit.checkpoint.restore_state` reports, or None when there is nothing to
        resume (a warning; an error with ``required=True``)."""
        self.prepare()
        if self.checkpointer is None:
            raise ConfigError("cannot resume: this run keeps no checkpoints")
        return self._restore(quiet=False, required=required)

    def _restore(self, *, quiet: bool, required: bool = False) -> dict[str, Any] | None:
        self._restore_done = True
        if self.checkpointer is None:
            self.sync_logs()
            return None
        with self._patient():
            state = self.checkpointer.load_latest()
        if state is None:
            if required:
                raise CheckpointError(f"no usable checkpoint in {self.checkpointer.dir}; "
                                      "nothing to resume")
            if not quiet:
                log.warning(f"no checkpoint in {self.checkpointer.dir} yet: starting from step 0")
            self.sync_logs()
            return None
        source = f"checkpoint of step {state.get('step')} in {self.checkpointer.dir}"
        ours = (state.get("extra") or {}).get("run")
        if not isinstance(ours, dict) or ours.get("format") != FORMAT:
            raise CheckpointError(f"{source} was not written by ddpkit.Run or ddpkit train; "
                                  "cannot resume it")
        if self.config_check is not None:
            self.config_check(state.get("config"), source)
        info = restore_state(state, model=self.model, optimizer=self.optimizer,
                             scheduler=self.scheduler, source=source,
                             config=None if self.config_check is not None else self.config)
        saved = state["extra"]["state"]
        missing = sorted(set(self.state) - set(saved))
        if missing:
            raise CheckpointError(f"{source} has no state for {missing}; it was saved without it")
        self.step = self.start_step = self._saved_step = int(ours["step"])
        self.epoch, self.position = int(ours["epoch"]), int(ours["position"])
        if self.sampler is not None and "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])  # checks seed and data size
            self.epoch, self.position = self.sampler.epoch, self.sampler.position
        for name, obj in self.state.items():
            obj.load_state_dict(saved[name])
        self.resumed_from = self.checkpointer.path_for(self.step)
        self._last_epoch = self.epoch if self.position else max(self.epoch - 1, 0)
        self.sync_logs()
        of = f" of {self.sampler.num_samples}" if self.sampler is not None else ""
        log.info(f"resumed at step {self.step} (epoch {self.epoch + 1}, sample "
                 f"{self.position}{of}) from {source}")
        return info

    def sync_logs(self) -> None:
        """Collective: the logs describe exactly the steps that led to the current state
        (lines of steps past it would be replayed and count twice)."""
        if self.dir is None:
            return
        if self.is_main:
            truncate_records(self.dir, self.step)
            truncate_sample_logs(self.dir, self.step)
        if _initialized() and self.world_size > 1:
            dist.barrier()  # nobody appends before rank 0 has cut the logs

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict[str, Any]:
        """Where the loop is (step, epoch, data position) and the ``state=`` objects."""
        return {"run": {"format": FORMAT, "step": self.step, "epoch": self.epoch,
                        "position": self.position},
                "state": {name: obj.state_dict() for name, obj in self.state.items()}}

    def save(self, reason: str = "manual") -> Path:
        """Collective: write a checkpoint of the current step now (every rank calls it)."""
        if self.checkpointer is None:
            raise ConfigError("Run.save() needs a run that keeps checkpoints, entered first "
                              "(`with run:`)")
        meta: dict[str, Any] = {"epoch": self.epoch}
        if self.config is not None:
            meta["fingerprint"] = config_fingerprint(self.config)
            meta["config"] = self.config
        with self.guarded("checkpoint"), self._patient():
            state = collect_state(
                model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                sampler=_Position(self) if self.sampler is not None else None,
                step=self.step, epoch=self.epoch, config=self.config,
                extra=self.state_dict(),
            )
            path = self.checkpointer.save(state, self.step, reason=reason, meta=meta)
        self.cadence.saved()
        self._saved_step = self.step
        if reason in ("final", "preempted"):
            log.info(f"checkpoint of step {self.step} ({reason}): {path}")
        return path



class _Position:
    """The sampler's state at the position the loop reached (not the one it was asked
    for last: a prefetching DataLoader is ahead)."""

    def __init__(self, run: RunCheckpoints):
        self.run = run

    def state_dict(self) -> dict[str, Any]:
        return {**self.run.sampler.state_dict(), "epoch": self.run.epoch,
                "position": self.run.position}
