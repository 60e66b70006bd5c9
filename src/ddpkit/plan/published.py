"""The cost model held to published measurements: torch DDP's own benchmark table.

PyTorch's DDP benchmark (``benchmarks/distributed/ddp/README.md`` in pytorch/pytorch)
reports step times of torchvision models on DGX-1 machines (8 V100 per node joined by
NVLink 2, four 100 Gb/s InfiniBand NICs per node, NCCL, 25 MB buckets): one GPU without
DDP (``no_ddp``), then 1-16 GPUs with DDP. A copy of those rows lives in
``benchmarks/data/torch_ddp_v100_published.csv``. Each row is predicted from what a
user knows before scaling out: the single-GPU step without DDP (``--step-ms``), the
parameter count and the number of parameter tensors, and the machine's presets.
"""

from __future__ import annotations

import csv
import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path

from ddpkit.errors import ConfigError
from ddpkit.plan.model import DEVICES, link
from ddpkit.plan.project import Workload, best, project

# The machine of the published table, as `ddpkit plan project` options.
SETUP = {"device": "v100", "intra": "nvlink2", "inter": "ib-edr", "gpus_per_node": 8,
         "nics_per_node": 4, "bucket_mb": 25.0}


@dataclass(frozen=True)
class PublishedRow:
    model: str
    params: int
    param_tensors: int
    no_ddp_s: float
    step_s: dict[int, float]  # GPUs -> published p50 step time with DDP


@dataclass(frozen=True)
class Comparison:
    model: str
    gpus: int
    published_s: float
    predicted_s: float
    algo: str

    @property
    def error(self) -> float:
        return (self.predicted_s - self.published_s) / self.published_s


def read_rows(path: str | Path) -> list[PublishedRow]:
    """Rows of the published table (``#`` lines are its provenance notes)."""
    try:
        lines = [ln for ln in Path(path).read_text().splitlines()
                 if ln.strip() and not ln.startswith("#")]
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    rows = []
    for rec in csv.DictReader(lines):
        try:
            gpus = {int(k[1:]): float(v) for k, v in rec.items() if k.startswith("g")}
            rows.append(PublishedRow(rec["model"], int(rec["params"]),
                                     int(rec["param_tensors"]), float(rec["no_ddp"]), gpus))
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{path}: row {rec} does not have the columns model, params, "
                              f"param_tensors, no_ddp, g1, g2, ... ({exc})") from None
    return rows


def command(row: PublishedRow, spread: float | None = None) -> str:
    """The `ddpkit plan project` command line that predicts ``row``."""
    counts = sorted(row.step_s)
    argv = ["ddpkit", "plan", "project", "--step-ms", f"{row.no_ddp_s * 1e3:g}",
            "--params", str(row.params), "--param-tensors", str(row.param_tensors),
            "--gpus", ",".join(map(str, counts)), "--device", SETUP["device"],
            "--intra", SETUP["intra"], "--inter", SETUP["inter"],
            "--gpus-per-node", str(SETUP["gpus_per_node"]),
            "--nics-per-node", str(SETUP["nics_per_node"]),
            "--bucket-mb", f"{SETUP['bucket_mb']:g}"]
    if spread is not None:
        argv += ["--spread", f"{spread:g}"]
    return shlex.join(argv)


def predict_row(row: PublishedRow, spread: float | None = None) -> list[Comparison]:
    """The model's prediction (its best algorithm) for every GPU count of ``row``."""
    device = DEVICES[SETUP["device"]]
    if spread is not None:
        device = dataclasses.replace(device, spread=spread)
    workload = Workload(params=row.params, step_s=row.no_ddp_s,
                        param_tensors=row.param_tensors, device=device,
                        bucket_cap_mb=SETUP["bucket_mb"])
    rows = project(workload, sorted(row.step_s), SETUP["gpus_per_node"],
                   link(SETUP["intra"]), link(SETUP["inter"]),
                   nics_per_node=SETUP["nics_per_node"])
    chosen = best(rows)
    return [Comparison(row.model, g, row.step_s[g], chosen[g].prediction.step_s,
                       chosen[g].algo) for g in sorted(row.step_s)]
