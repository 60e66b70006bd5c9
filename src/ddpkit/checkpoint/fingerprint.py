"""Config fingerprints: a short stable hash of a run's config, and the fields in which
two configs differ."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any


def _config_json(config: Any) -> str:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return json.dumps(config, sort_keys=True, default=str)


def config_fingerprint(config: Any) -> str:
    """A short stable hash of a config (dataclass or JSON-able mapping)."""
    return hashlib.sha256(_config_json(config).encode()).hexdigest()[:16]


def config_changes(saved: Any, current: Any) -> list[str]:
    """``["model.hidden: [32] -> [64]", ...]``: the fields that differ between two
    configs (dataclasses, mappings or their JSON text), flattened to dotted names."""
    saved, current = (json.loads(c) if isinstance(c, str) else json.loads(_config_json(c))
                      for c in (saved, current))
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return [] if saved == current else ["config differs"]
    flat_saved, flat_current = _flatten(saved), _flatten(current)
    return [
        f"{k}: {flat_saved.get(k, '<unset>')!r} -> {flat_current.get(k, '<unset>')!r}"
        for k in sorted(set(flat_saved) | set(flat_current))
        if flat_saved.get(k, "<unset>") != flat_current.get(k, "<unset>")
    ]


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
