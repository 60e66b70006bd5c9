"""Your own training loop with what ``ddpkit train`` has: :class:`Run`.

* ``run``: :class:`Run`, one job in one directory: resume, preemption, hang detection,
  checkpoint cadence, the exact data position and rank-0 metric records.
* ``run_checkpoints``: the run's checkpoints: what it saves and how it resumes.
* ``loader``: the run's data side: the loader checked against the sampler, its workers
  kept alive through stop signals, exact mode's slice count, the sample ids of a step.
* ``metrics_log``: metrics.jsonl (its one writer and reader) / metrics.csv /
  TensorBoard writers (rank 0).
* ``sample_ids``: per-rank logs of the sample ids trained on at each step.
* ``inject``: the ``DDPKIT_TEST_*`` faults the fault-tolerance tests inject.
"""

from ddpkit.loop.run import Run, Stateful

__all__ = ["Run", "Stateful"]
