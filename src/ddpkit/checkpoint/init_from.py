"""Starting a run from a checkpoint someone else wrote: ``Run(init_from=DIR)``,
``ddpkit train --init-from DIR``.

DIR is a torch.distributed.checkpoint directory: torch DDP's or FSDP2's
``dcp.save({"model": ..., "optimizer": ...})`` of ``get_state_dict(model, optimizer)``,
a torchtitan step folder, or a ddpkit checkpoint (a run directory or its ``checkpoints``
folder: the newest good checkpoint there). Every rank loads the model, and the
optimizer's state where the checkpoint holds one, at this run's world size and
sharding, whatever wrote it. Only the weights and the optimizer's state come in:
this run's own settings (learning rate, schedule, data position, step count) start
fresh.

Programs store the two under different top-level names (``model.`` / ``optimizer.``,
``app.model.`` / ``app.optim.``, none at all): the prefixes are found by matching the
model's own parameter names against the checkpoint's keys. A checkpoint that does
not fit is one line naming the missing, extra and mis-shaped names.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.common import CheckpointError
from ddpkit.checkpoint.dcp_files import METADATA, read_metadata
from ddpkit.checkpoint.dcp_load import load_dcp
from ddpkit.checkpoint.model_state import _preview, unwrap
from ddpkit.checkpoint.store import Checkpointer
from ddpkit.log import get_logger

log = get_logger(__name__)


def dcp_directory(directory: str | os.PathLike) -> Path:
    """The DCP checkpoint ``directory`` names: itself, or a ddpkit run's newest good one."""
    path = Path(directory)
    if (path / METADATA).is_file():
        return path
    for where in (path, path / "checkpoints"):
        if where.is_dir():
            info = Checkpointer(where, create=False).latest()
            if info is not None and (info.path / METADATA).is_file():
                return info.path
    if not path.exists():
        raise CheckpointError(f"--init-from {path}: no such directory; give a "
                              "torch.distributed.checkpoint directory (one with a .metadata)")
    raise CheckpointError(f"--init-from {path}: no {METADATA} there, so not a "
                          "torch.distributed.checkpoint directory (nor a ddpkit run with one)")


def _prefix(keys: list[str], names: set[str]) -> tuple[str | None, int]:
    """The top-level name under which ``keys`` hold ``names`` (most matches wins)."""
    found: Counter[str] = Counter()
    for key in keys:
        parts = key.split(".")
        for cut in range(len(parts)):
            if ".".join(parts[cut:]) in names:
                found[".".join(parts[:cut]) + ("." if cut else "")] += 1
                break
    return found.most_common(1)[0] if found else (None, 0)


def _optimizer_prefix(keys: list[str], names: set[str]) -> str | None:
    """The top-level name of ``<prefix>state.<parameter name>.<key>`` entries."""
    found: Counter[str] = Counter()
    for key in keys:
        at = key.find("state.")
        while at >= 0:
            name = key[at + 6:].rpartition(".")[0]
            if name in names and (at == 0 or key[at - 1] == "."):
                found[key[:at]] += 1
                break
            at = key.find("state.", at + 1)
    return found.most_common(1)[0][0] if found else None


def init_from(directory: str | os.PathLike, model: Any, optimizer: Any = None) -> dict[str, Any]:
    """Collective: give ``model`` (and ``optimizer``, when the checkpoint holds its
    state) the weights of the DCP checkpoint ``directory``. Returns what was loaded."""
    path = dcp_directory(directory)
    source = f"--init-from {path}"
    keys = list(read_metadata(path).state_dict_metadata)
    gather = getattr(model, "gather_parameters", None)
    if callable(gather):  # ZeRO: the module's state dict is readable only gathered
        gather()
    names = {n.removeprefix("module.") for n in unwrap(model).state_dict()}
    model_prefix, matched = _prefix(keys, names)
    if model_prefix is None:
        raise CheckpointError(f"{source}: none of this model's {len(names)} parameter names is "
                              f"in it (it holds {_preview(sorted(keys), 5)}); it was written "
                              "for another model")
    params = {n.removeprefix("module.") for n, _ in unwrap(model).named_parameters()}
    optimizer_prefix = _optimizer_prefix(keys, params)
    with_optimizer = optimizer is not None and optimizer_prefix is not None
    load_dcp(path, model, optimizer if with_optimizer else None, model_prefix=model_prefix,
             optimizer_prefix=optimizer_prefix or "", keep_groups=True, source=source)
    loaded = {"path": str(path), "model": model_prefix, "optimizer": optimizer_prefix
              if with_optimizer else None, "tensors": matched}
    log.info(f"initialized from {path}: model ({matched} tensors under '{model_prefix}')"
             + (f", optimizer state (under '{optimizer_prefix}')" if with_optimizer else ""))
    return loaded


def init_fresh_run(run: Any) -> None:
    """``ddpkit.Run``'s hook when it is entered: a run that did not resume starts from
    its ``init_from`` checkpoint (once)."""
    if run.init_from is None or run.resumed_from is not None or run.step != 0:
        return
    if getattr(run, "initialized_from", None) is None:
        run.initialized_from = init_from(run.init_from, run.model, run.optimizer)
