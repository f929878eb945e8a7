"""A process group's size and this rank's place in it; 1 and 0 where torch.distributed is not started (one
process, as burst.attention runs without init_process_group)."""

from __future__ import annotations

import torch.distributed as dist


def group_size(group=None) -> int:
    """Ranks in `group` (None: the default group), 1 without torch.distributed."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """This process's rank in `group` (None: the default group), 0 without torch.distributed."""
    return dist.get_rank(group) if dist.is_initialized() else 0
