"""torch DistributedDataParallel's surface on ddpkit's engine, beyond the training step.

Owns torch's constructor arguments and methods (``torch_compat``), pickling and deep
copies (``ddp_pickle``), torch's logging dictionary (``ddp_logging``) and sparse
embedding gradients, reduced as torch reduces them (``sparse_grads``).
"""
