"""Keeping replicas identical: shape checks and coalesced broadcasts of model state."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError

# Flatten at most this many bytes per broadcast so a huge model does not need a second
# full copy of itself in memory at construction.
BROADCAST_CHUNK_BYTES = 64 * 1024 * 1024


def _describe(entry: tuple) -> str:
    _, shape, dtype = entry
    return f"shape {tuple(shape)} {dtype}"


def verify_same_layout(
    params: Sequence[tuple[str, torch.Tensor]],
    buffers: Sequence[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup | None,
) -> None:
    """Raise ConfigError on every rank if any rank's parameters differ in name, shape or dtype.

    Every rank gathers every rank's layout, so all ranks reach the same verdict and raise
    together instead of some of them hanging in the next collective.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    layout = {
        "parameter": [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in params],
        "buffer": [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in buffers],
    }
    gathered: list[dict] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, layout, group=group)
    for kind in ("parameter", "buffer"):
        reference = gathered[0][kind]
        for rank in range(1, world_size):
            other = gathered[rank][kind]
            for position, (ref, got) in enumerate(zip(reference, other)):
                if ref != got:
                    if ref[0] != got[0]:
                        detail = (f"{kind} #{position} is {ref[0]!r} ({_describe(ref)}) on rank 0 "
                                  f"but {got[0]!r} ({_describe(got)}) on rank {rank}")
                    else:
                        detail = (f"{kind} {ref[0]!r} has {_describe(ref)} on rank 0 "
                                  f"but {_describe(got)} on rank {rank}")
                    raise ConfigError(
                        f"DataParallel: models differ across ranks: {detail}; every rank must "
                        "build the same model (same layers, shapes, dtypes) before wrapping it"
                    )
            if len(reference) != len(other):
                longer, rank_long = (reference, 0) if len(reference) > len(other) else (other, rank)
                extra = longer[min(len(reference), len(other))][0]
                raise ConfigError(
                    f"DataParallel: models differ across ranks: rank 0 has {len(reference)} "
                    f"{kind}s, rank {rank} has {len(other)} (first extra: {extra!r} on rank "
                    f"{rank_long}); every rank must build the same model before wrapping it"
                )


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup | None
) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values, few messages.

    Tensors are packed per (device, dtype) into flat chunks: one broadcast per chunk
    instead of one per tensor (a BatchNorm model has three buffers per layer). Every
    chunk goes through ``torch.distributed.broadcast`` on ``group``.
    """
    if dist.get_world_size(group) == 1 or not tensors:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for members in groups.values():
            chunk: list[torch.Tensor] = []
            size = 0
            for t in members:
                chunk.append(t)
                size += t.numel() * t.element_size()
                if size >= BROADCAST_CHUNK_BYTES:
                    _broadcast_chunk(chunk, src, group)
                    chunk, size = [], 0
            if chunk:
                _broadcast_chunk(chunk, src, group)


def _broadcast_chunk(chunk: list[torch.Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    if len(chunk) == 1 and chunk[0].is_contiguous():
        dist.broadcast(chunk[0], group=group, group_src=src)
        return
    flat = torch.cat([t.reshape(-1) for t in chunk])
    dist.broadcast(flat, group=group, group_src=src)
    offset = 0
    for t in chunk:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# Byte packing for transports that move raw bytes (shm): every tensor starts on a
# multiple of this, so a byte slice can be viewed back as its dtype.
PACK_ALIGN = 16


class BytePacker:
    """Packs a fixed list of CPU tensors of any dtypes into one flat byte tensor and back.

    Built once per list (the buffers DataParallel broadcasts before every forward), so a
    forward packs and unpacks with no planning and no allocation: one broadcast of the
    packed bytes replaces one per (dtype, chunk).
    """

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)
        self.offsets: list[int] = []
        offset = 0
        for t in self.tensors:
            self.offsets.append(offset)
            nbytes = t.numel() * t.element_size()
            offset += -(-nbytes // PACK_ALIGN) * PACK_ALIGN
        self.flat = torch.zeros(max(offset, 1), dtype=torch.uint8)
        self.views = [
            self.flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(self.offsets, self.tensors)
        ]

    def pack(self) -> torch.Tensor:
        with torch.no_grad():
            for view, t in zip(self.views, self.tensors):
                view.copy_(t)
        return self.flat

    def unpack(self) -> None:
        with torch.no_grad():
            for view, t in zip(self.views, self.tensors):
                t.copy_(view)


def broadcast_packed(packer: BytePacker, src: int, is_src: bool,
                     broadcast: Callable[[torch.Tensor, int], object]) -> None:
    """Broadcast ``packer``'s tensors from group rank ``src`` as one byte message."""
    flat = packer.pack() if is_src else packer.flat
    broadcast(flat, src)
    if not is_src:
        packer.unpack()
