"""Where this rank sits in a process group, in the group's own numbering.

Point-to-point calls take global ranks while ring positions are group ranks; keeping
the translation here lets every algorithm work unchanged on subgroups.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from ddpkit.errors import CommError


def _default_group() -> None:
    return None


@dataclass(frozen=True)
class GroupView:
    # Weak: views are cached per group, and a cache must not keep its group (and the
    # group's backend threads) alive past destroy_process_group (ddpkit.runtime.lifetime).
    group_ref: Callable[[], dist.ProcessGroup | None]
    rank: int  # this process's rank inside the group
    size: int
    global_ranks: tuple[int, ...]  # global rank of each group rank

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group (None means the default group, as in torch)."""
        if self.group_ref is _default_group:
            return None
        group = self.group_ref()
        if group is None:
            raise CommError("this process group was destroyed; create a new one")
        return group

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank % self.size]

    @property
    def right(self) -> int:
        """Global rank this rank sends to around the ring."""
        return self.global_rank(self.rank + 1)

    @property
    def left(self) -> int:
        """Global rank this rank receives from around the ring."""
        return self.global_rank(self.rank - 1)

    def group_rank_of(self, global_rank: int, what: str) -> int:
        try:
            return self.global_ranks.index(global_rank)
        except ValueError:
            raise CommError(
                f"{what}={global_rank} is not a member of the group (global ranks "
                f"{list(self.global_ranks)}); pass a global rank of the group"
            ) from None


def require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise CommError(
            "no process group: call ddpkit.init() (or torch.distributed.init_process_group) first"
        )


def view(group: dist.ProcessGroup | None) -> GroupView | None:
    """This rank's view of ``group``, or None when this rank is not a member (torch then
    makes the collective a no-op, and so do we)."""
    require_initialized()
    if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    rank = dist.get_rank(group)
    if rank < 0:
        return None
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    ref = _default_group if group is None else weakref.ref(group)
    return GroupView(ref, rank, len(ranks), ranks)
