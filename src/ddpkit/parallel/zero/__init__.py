"""``DataParallel(model, shard=...)``: ZeRO stages 1, 2 and 3 on the engine's buckets.

Owns which chunk of every bucket each rank holds (``shard_layout``), the shard
parameters the optimizer steps and their gathering (``sharded_params``), ZeRO-2's
reduce-scatter through one scratch buffer (``scatter_reducer``), ZeRO-3's per-module
gathering (``layer_gathering``), the optimizer state cut by parameter for checkpoints
(``sharded_state``) and what ties them to the engine (``sharding``).
"""
