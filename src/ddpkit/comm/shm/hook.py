"""DataParallel comm hook over shared memory, with gradient buckets allocated in it.

    state = ShmState()
    model = ddpkit.DataParallel(net, comm_hook=shm_hook, comm_state=state)

The engine sees ``state.allocate(numel, dtype, device)`` and places each bucket's flat
gradient storage in the shared segment, so backward writes gradients where the peers
can read them and the all-reduce copies nothing in or out. The hook also works with
torch's DistributedDataParallel (``register_comm_hook(state, shm_hook)``), whose
buckets are private memory: then it copies through the shared slots.

If shared memory cannot be set up (no /dev/shm, too little space) every rank learns it
at the same collective, logs one warning and uses the backend's all_reduce instead:
training goes on, only slower.
"""

import torch
import torch.distributed as dist

from ddpkit.comm.shm.algorithm import backend_all_reduce
from ddpkit.comm.shm.communicator import ShmCommunicator
from ddpkit.errors import CommError
from ddpkit.log import get_logger

log = get_logger(__name__)


class ShmState:
    """Comm state for :func:`shm_hook`; holds one :class:`~ddpkit.comm.shm.ShmCommunicator`.

    Keyword options are passed to the communicator (``slot_mb``, ``timeout``,
    ``host_id``). The communicator is created collectively on first use.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, **options):
        self.group = group
        self.options = options
        self._comm: ShmCommunicator | None = None
        self._fallback = False

    @property
    def communicator(self) -> ShmCommunicator | None:
        if self._comm is None and not self._fallback:
            try:
                self._comm = ShmCommunicator(self.group, **self.options)
            except CommError as exc:
                self._use_backend(exc)
        return self._comm

    def _use_backend(self, exc: Exception) -> None:
        log.warning(f"shm comm hook: shared memory unavailable ({exc}); using the backend")
        self._fallback = True

    def allocate(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Storage for one gradient bucket: shared memory for CPU buckets (collective)."""
        comm = self.communicator if torch.device(device).type == "cpu" else None
        if comm is not None:
            try:
                return comm.allocate(numel, dtype)
            except CommError as exc:  # every rank saw the same failure: fall back together
                log.warning(f"shm comm hook: bucket of {numel} elements stays private ({exc})")
        return torch.empty(numel, dtype=dtype, device=device)

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "avg", *, divisor: int | None = None
    ) -> torch.Tensor:
        comm = self.communicator if tensor.device.type == "cpu" else None
        if comm is not None:
            return comm.all_reduce(tensor, op, divisor=divisor)
        backend_all_reduce(tensor, "sum" if op == "avg" else op, self.group)
        if op == "avg" and divisor is None:
            divisor = dist.get_world_size(self.group)
        if divisor is not None and divisor != 1:
            tensor.div_(divisor)
        return tensor

    def close(self) -> None:
        if self._comm is not None:
            self._comm.close()
            self._comm = None


# No postponed annotations in this module: torch's DDP checks the hook's return
# annotation against the real Future[Tensor] object.
def shm_hook(state: ShmState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients across ranks in place; returns a completed future.

    Divides by ``bucket.divisor()`` where the engine provides it (ddpkit's DataParallel:
    fewer ranks while some have joined), else by the group size (torch's GradBucket).
    The reduction runs synchronously: with ranks sharing cores, a communication thread
    would only compete with backward for the same cycles.
    """
    buffer = bucket.buffer()
    divisor = bucket.divisor() if hasattr(bucket, "divisor") else dist.get_world_size(state.group)
    state.all_reduce(buffer, "sum", divisor=divisor)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future
