"""Fit a link's alpha and beta to measured all-reduce times.

The measurements are `ddpkit bench collectives` rows (its JSON file, or a fresh run of
the same benchmark): all-reduce of ``n`` bytes over ``p`` ranks in median seconds. The
ring model says ``t = 2(p-1) alpha + 2(p-1)/p n beta``, a straight line ``a + b n`` in
``n``; we fit ``a`` and ``b`` by least squares on *relative* error (sizes span six
orders of magnitude: absolute error would let the largest size decide everything) and
read alpha and beta off the line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ddpkit.errors import ConfigError
from ddpkit.plan.model import Cluster, Link, allreduce_time


@dataclass(frozen=True)
class Calibration:
    """A fitted link and the points it was fitted to."""

    nranks: int
    alpha_s: float
    bandwidth_Bps: float
    points: tuple[tuple[int, float], ...]  # (bytes, measured seconds)
    source: str = ""

    def link(self, name: str = "measured") -> Link:
        return Link(name, self.alpha_s, self.bandwidth_Bps)

    def cluster(self) -> Cluster:
        """The measured machine: one node, ``nranks`` ranks joined by the fitted link."""
        ln = self.link()
        return Cluster(nodes=1, gpus_per_node=self.nranks, intra=ln, inter=ln)

    def predict(self, nbytes: float) -> float:
        return allreduce_time(nbytes, self.cluster(), "ring")

    def errors(self) -> list[tuple[int, float, float, float]]:
        """(bytes, measured s, predicted s, relative error) for every point."""
        out = []
        for nbytes, measured in self.points:
            predicted = self.predict(nbytes)
            out.append((nbytes, measured, predicted, (predicted - measured) / measured))
        return out

    def to_json(self) -> dict:
        return {**asdict(self), "points": [list(p) for p in self.points]}

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        try:
            return cls(nranks=int(data["nranks"]), alpha_s=float(data["alpha_s"]),
                       bandwidth_Bps=float(data["bandwidth_Bps"]),
                       points=tuple((int(b), float(t)) for b, t in data["points"]),
                       source=str(data.get("source", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"calibration file lacks or mangles {exc}; "
                              "re-create it with `ddpkit plan calibrate`") from None


def fit(points: Sequence[tuple[int, float]], nranks: int, source: str = "") -> Calibration:
    """Least-squares alpha/beta (relative error) for ring all-reduce over ``nranks``."""
    if nranks < 2:
        raise ConfigError(f"calibration needs all-reduce over >= 2 ranks, got {nranks}")
    pts = sorted((int(b), float(t)) for b, t in points if t > 0)
    if len({b for b, _ in pts}) < 2:
        raise ConfigError("calibration needs times for at least two different sizes")
    n = np.array([b for b, _ in pts], dtype=float)
    t = np.array([s for _, s in pts], dtype=float)
    # minimise sum(((a + b n) - t) / t)^2: rows scaled by 1/t
    design = np.stack([1 / t, n / t], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if b <= 0:
        raise ConfigError("all-reduce time does not grow with size in these measurements; "
                          "measure larger sizes (up to tens of MiB)")
    if a < 0:  # latency below resolution: fit the slope alone
        a = 0.0
        b = float(np.sum(n / t) / np.sum((n / t) ** 2))
    steps = 2 * (nranks - 1)
    alpha = a / steps
    bandwidth = steps / nranks / b
    return Calibration(nranks, float(alpha), float(bandwidth), tuple(pts), source)


def points_from_bench_json(path: str | Path, algo: str = "backend") -> tuple[list, int]:
    """(bytes, seconds) rows and rank count from a `ddpkit bench collectives` JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; run `ddpkit bench collectives` first") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    rows = [r for r in data.get("rows", [])
            if r.get("op") == "all_reduce" and r.get("algo") == algo]
    if not rows:
        raise ConfigError(f"{path} has no all_reduce rows for algorithm {algo!r}; "
                          "run `ddpkit bench collectives --op all_reduce --algo backend`")
    ranks = {int(r["nranks"]) for r in rows}
    if len(ranks) != 1:
        raise ConfigError(f"{path} mixes rank counts {sorted(ranks)}; use one run")
    return [(int(r["bytes"]), float(r["time_us"]) * 1e-6) for r in rows], ranks.pop()
