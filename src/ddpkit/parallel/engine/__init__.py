"""The DDP engine's default path: what every DataParallel step runs through.

Owns the gradient buckets (``buckets``), the reducer that fills them from autograd's
hooks and reduces them while backward runs (``reducer``), the transports that move a
bucket (``transport``: the backend, the ring, shared memory, and what ``comm="auto"``
means), the initial and per-step state broadcasts (``state_sync``) and the per-model
bookkeeping of uneven inputs (``join_state``).
"""
