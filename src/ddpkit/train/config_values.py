"""Raw config values as they arrive: from a TOML file (``--config``), a resumed run's
saved settings or the command line. Read, renamed keys brought to their current names,
each value checked against its field's type; :mod:`ddpkit.train.config` builds the
(frozen, checked) config from them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError


def coerce(value: Any, current: Any, f: dataclasses.Field, key: str) -> Any:
    """Check a file/CLI value against the field's type (bool is not an int here)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{key} must not be empty")
    if kind.startswith("list"):
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{key} must be a list of integers, got {value!r}")
        return list(value)
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    return value


# Keys that were renamed: a config file or a run's saved settings that use the old name
# still load (section, old key) -> new key.
RENAMED_KEYS = {("train", "virtual_shards"): "slices"}


def with_current_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` (``{section: {key: value}}``) with renamed keys under their current names."""
    out: dict[str, Any] = {}
    for section, values in raw.items():
        if isinstance(values, Mapping):
            values = {RENAMED_KEYS.get((section, k), k): v for k, v in values.items()}
        out[section] = values
    return out


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(
                "reading --config needs Python >= 3.11 or `pip install tomli`"
            ) from None
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                          f"at offset {exc.start}); TOML files are UTF-8: save it as UTF-8")\
            from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None


__all__ = ["RENAMED_KEYS", "coerce", "read_toml", "with_current_keys"]
