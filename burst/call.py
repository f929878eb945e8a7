"""AttentionCall: everything a strategy needs to know about one sharded attention call."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist

from .layout import Segment, segments
from .masks import MaskSpec, Tile, may_attend, plan_tiles


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One call's setting, fixed on every rank: the group, how the sequence is laid out, the mask.

    local_len: tokens per rank. kernel: a backend module from burst.kernels. options: the
    strategy's own keyword options (Strategy.options), as the caller gave them.
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    layout: str
    local_len: int
    spec: MaskSpec
    scale: float
    kernel: object
    options: dict = field(default_factory=dict)

    def segments(self, rank: int) -> list[Segment]:
        """The position runs of `rank`'s shard."""
        return segments(self.layout, rank, self.world, self.local_len)

    def tiles(self, q_rank: int, k_rank: int) -> list[Tile]:
        """Kernel calls for `q_rank`'s queries against `k_rank`'s keys (empty when the mask skips all)."""
        return self.plan(self.segments(q_rank), self.segments(k_rank))

    def plan(self, q_segs: list[Segment], k_segs: list[Segment]) -> list[Tile]:
        """Kernel calls for any query runs against any key runs, sized for this call's kernel."""
        return plan_tiles(q_segs, k_segs, self.spec, max_rows=self.kernel.MAX_ROWS)

    @cached_property
    def ring_steps(self) -> int:
        """Ring steps that carry work: 1 + the largest s such that some rank r's queries attend the
        keys of rank r - s. A sliding window or local documents end the ring early (distflashattn.md
        App. D); every rank computes the same number from the mask alone."""
        steps = 1
        for r in range(self.world):
            q_segs = self.segments(r)
            for s in range(self.world - 1, steps - 1, -1):
                if may_attend(q_segs, self.segments((r - s) % self.world), self.spec):
                    steps = s + 1
                    break
        return steps
