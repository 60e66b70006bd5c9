"""Which samples each rank trained on, step by step (``--log-sample-ids``).

The log is :class:`ddpkit.Run`'s, which ``ddpkit train`` is built on: see
:mod:`ddpkit.loop.sample_ids` for the format and the replay rule after a resume.
"""

from ddpkit.loop.sample_ids import SAMPLE_DIR, SampleLog, read_sample_logs, truncate_sample_logs

__all__ = ["SAMPLE_DIR", "SampleLog", "read_sample_logs", "truncate_sample_logs"]
