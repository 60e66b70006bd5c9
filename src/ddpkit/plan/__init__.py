"""``ddpkit plan``: an alpha-beta cost model of bucketed data-parallel training.

model.py: links, all-reduce algorithms (ring, tree, hierarchical), buckets, step time;
calibrate.py: fit a link to `ddpkit bench collectives` measurements;
validate.py: compare predictions with a real DDP step on this machine;
project.py: step time and scaling efficiency at 1-1024 GPUs.
"""

from ddpkit.plan.calibrate import Calibration, fit
from ddpkit.plan.model import (
    ALGOS,
    PRESETS,
    Cluster,
    Link,
    StepModel,
    StepPrediction,
    allreduce_time,
    bucket_sizes,
    predict_step,
)

__all__ = [
    "ALGOS",
    "PRESETS",
    "Calibration",
    "Cluster",
    "Link",
    "StepModel",
    "StepPrediction",
    "allreduce_time",
    "bucket_sizes",
    "fit",
    "predict_step",
]
