"""A process group's size and this rank's place in it; 1 and 0 where torch.distributed is not started (one
process, as burst.attention runs without init_process_group)."""

from __future__ import annotations

import torch.distributed as dist


def group_size(group=None) -> int:
    """Ranks in `group` (None: the default group), 1 without torch.distributed."""
    check_member(group)
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """This process's rank in `group` (None: the default group), 0 without torch.distributed."""
    check_member(group)
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_ranks(group=None) -> tuple[int, ...]:
    """The global ranks of `group` (None: the default group), in its order; (0,) without torch.distributed."""
    if not dist.is_initialized():
        return (0,)
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (a parameter or gradient FSDP2 or tensor parallel shards over a DeviceMesh)."""
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)  # without importing torch.distributed.tensor


def check_member(group) -> None:
    """TypeError for what is not a process group (a DeviceMesh: the group of one of its dims is); ValueError on a
    rank that is not in `group`: dist.new_group hands the ranks outside it GroupMember.NON_GROUP_MEMBER, for
    which torch answers a size and rank of -1."""
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this process (global rank {dist.get_rank() if dist.is_initialized() else 0}) is not a member of the "
            "group it passed (dist.new_group returns GroupMember.NON_GROUP_MEMBER on the ranks outside it): call "
            "burst only on the ranks of the group"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):  # a DeviceMesh, a list of ranks...
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None (the default group), got {type(group).__name__}"
            f"{': pass mesh.get_group() (a 1-D mesh) or mesh[dim].get_group()' if hasattr(group, 'get_group') else ''}"
        )
