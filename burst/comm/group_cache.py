"""Caches keyed by process group, whose entries go with their group.

burst keeps a few things per group: its shared-memory channels (p2p.py), USP's subgroups. A cache
that holds a group keeps it alive after torch.distributed.destroy_process_group, and a gloo group
alive into the interpreter's teardown can abort the process at exit ("terminate called without an
active exception": 2-12 of 20 two-rank worlds that had opened channels, none once they were released
first). A re-made group would also find a destroyed one's entries. So an entry leaves once torch has
destroyed its group (looked at whenever an entry is added), and every cache is emptied at exit,
before the teardown.
"""

from __future__ import annotations

import atexit
import gc

import torch.distributed as dist

_CACHES: list["GroupCache"] = []


class GroupCache(dict):
    """A dict from process group to anything; `None` stands for the default group."""

    def __init__(self) -> None:
        super().__init__()
        _CACHES.append(self)

    @staticmethod
    def key(group):
        return group if group is not None else dist.group.WORLD

    def of(self, group, default=None):
        return self.get(self.key(group), default) if self else default

    def holds(self, group) -> bool:
        return self.key(group) in self

    def put(self, group, value) -> None:
        for cache in _CACHES:
            for stale in [g for g in cache if not _alive(g)]:
                del cache[stale]
        self[self.key(group)] = value


def _alive(group) -> bool:
    try:
        dist.get_process_group_ranks(group)  # a KeyError once torch has destroyed the group
        return True
    except (KeyError, RuntimeError, ValueError):
        return False


@atexit.register
def _release() -> None:
    for cache in _CACHES:
        cache.clear()
    gc.collect()  # the channels and groups sit in reference cycles: free them now, not in the teardown
