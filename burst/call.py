"""AttentionCall: everything a strategy needs to know about one sharded attention call."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Callable

import torch
import torch.distributed as dist

from .comm.topology import Topology, ranks_per_node
from .kernels.attend import attend_backward, attend_forward
from .layout import Segment, segments
from .masks import Cover, MaskSpec, Tile, TileSizes, may_attend, plan_tiles
from .schedules.chunk_stream import BoundedCache
from .schedules.ring import RingSchedule


@dataclass(frozen=True)
class Options:
    """A strategy's own options: none here. A strategy with options subclasses this with one field per
    option (default: the strategy's choice) and validates the values in __post_init__."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AttentionRequest:
    """What one burst.attention call asks for besides its tensors (q, the key side, sinks): the keywords
    as the caller passed them, unchecked. validation.checked_key_call turns it into an AttentionCall;
    prepare.py, api.py and custom_op.py hand it on whole. options: the strategy's own keywords."""

    group: dist.ProcessGroup | None = None
    strategy: str = "burst"
    layout: object = "contiguous"  # a layout name or a burst.DocumentLayout
    causal: bool = False
    window: tuple[int, int] | None = None
    softmax_scale: float | None = None
    return_lse: bool = False
    cu_seqlens: object = None
    block_sparse: object = None  # burst.BlockSparseMask
    topology: Topology | None = None
    softcap: float = 0.0
    chunk_size: int | None = None
    indices: object = None  # a tensor or burst.BlockIndices
    compressed: object = None  # burst.CompressedKV
    options: dict = field(default_factory=dict)

    @classmethod
    def of(cls, **keywords) -> "AttentionRequest":
        """burst.attention's keywords as one request: those it names, and the rest as options."""
        named = {f.name for f in fields(cls)} - {"options"}
        return cls(
            **{k: v for k, v in keywords.items() if k in named},
            options={k: v for k, v in keywords.items() if k not in named},
        )


TILE_BYTES = 400  # a Tile, its two Segments and its dict, roughly


_DENSE_WHEN_USED = (Cover.PARTIAL, Cover.RULE)  # tiles that build a q x k bool mask on use (band tiles pass Bands)


def _plan_bytes(tiles) -> int:
    """What a plan holds: its tiles, the q x k bools of each tile that builds its dense mask (partial and rule
    tiles, on first use), and the block-sparse layout its mask spec keeps (each tile holds the spec: a mask new at
    every call had kept every layout alive, uncounted, ~8 MB a call)."""
    held = sum(TILE_BYTES + (t.q.length * t.k.length if t.cover in _DENSE_WHEN_USED else 0) for t in tiles)
    sparse = tiles[0].spec.block_sparse if tiles else None
    return held + (sparse.layout.numel() if sparse is not None else 0)


# Planned tiles by (mask, query runs, key runs, sizes): every layer of a model plans the same block
# pairs at every step, and a masked plan takes milliseconds (a window's 8K-row shard: ~4 ms per block
# pair). Bounded by the bytes its plans hold; a plan over 4 MiB is not kept (huge shards plan in a
# negligible share of their compute; a block-sparse layout of 2048 x 2048 blocks replans each call).
_TILES = BoundedCache(16 << 20, size=_plan_bytes, largest=4 << 20)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One call's setting, fixed on every rank: the group, how the sequence is laid out, the mask.

    local_len: tokens per rank. kernel: a backend module from burst.kernels. options: the
    strategy's own options (its Strategy.options dataclass, built from the caller's keywords). topology: which
    ranks share a node (burst.Topology, resolved).
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    layout: str
    local_len: int
    spec: MaskSpec
    scale: float
    kernel: object
    options: Options = field(default_factory=Options)
    topology: Topology | None = None
    shard_segments: Callable[[int], list[Segment]] | None = None  # overrides the layout (USP's ring)
    indices: torch.Tensor | None = None  # (batch, local_len[, kv_heads], topk) chosen keys (masks/selection.py)
    index_block: int = 1  # keys per entry of indices: 1 for key positions, a BlockIndices' block_size

    def segments(self, rank: int) -> list[Segment]:
        """The position runs of `rank`'s shard."""
        if self.shard_segments is not None:
            return self.shard_segments(rank)
        return segments(self.layout, rank, self.world, self.local_len)

    def tiles(self, q_rank: int, k_rank: int) -> list[Tile]:
        """Kernel calls for `q_rank`'s queries against `k_rank`'s keys (empty when the mask skips all)."""
        return self.plan(self.segments(q_rank), self.segments(k_rank))

    def plan(
        self, q_segs: list[Segment], k_segs: list[Segment], max_rows: int | None = None, spec: MaskSpec | None = None
    ) -> list[Tile]:
        """Kernel calls for any query runs against any key runs, sized for this call's kernel (at most
        `max_rows` rows each way when given, to bound each call's fresh outputs), under this call's
        mask or `spec` (the compressed entries' own, compressed.py)."""
        spec = self.spec if spec is None else spec
        # full tiles joined across a zigzag shard's halves, unless an index selection reads positions
        sizes = TileSizes.for_kernel(self.kernel, max_rows, join_runs=self.indices is None)
        key = (spec.key, tuple(q_segs), tuple(k_segs), sizes)
        return _TILES.get(key, lambda: tuple(plan_tiles(q_segs, k_segs, spec, sizes=sizes)))  # shared: read only

    def attend_forward(self, q, k, v, tiles: list[Tile], out_acc, lse_acc, indices=...) -> None:
        """kernels.attend.attend_forward with this call's kernel, scale and index selection. indices: the
        selection of these query rows when they are not this rank's (a visiting block's), else the call's."""
        attend_forward(self.kernel, q, k, v, tiles, out_acc, lse_acc, self.scale, *self._selection(indices))

    def attend_backward(self, dout, q, k, v, out, lse, tiles: list[Tile], dq, dk, dv, delta=None, indices=...) -> None:
        """kernels.attend.attend_backward with this call's kernel, scale and index selection (out None
        and delta: BurstAttention's smaller backward side; indices: as attend_forward's)."""
        selection = self._selection(indices)
        attend_backward(self.kernel, dout, q, k, v, out, lse, tiles, dq, dk, dv, self.scale, delta, *selection)

    def _selection(self, indices) -> tuple:
        return (self.indices if indices is ... else indices), self.index_block

    @cached_property
    def mask_key(self) -> tuple:
        """Equal for two calls whose tiles are the same on every rank pair: every rank's segments and
        the mask (what plans that depend only on those may be cached under)."""
        return (self.world, tuple(tuple(self.segments(r)) for r in range(self.world)), self.spec.key)

    def chunk_segments(self, rank: int, start: int, stop: int) -> list[Segment]:
        """The position runs of rows [start, stop) of `rank`'s shard, numbered from `start`: the
        segments of a chunk that travels on its own (strategies/burst_stream.py)."""
        chunk = []
        for seg in self.segments(rank):
            lo, hi = max(start, seg.local_start), min(stop, seg.local_start + seg.length)
            if lo < hi:
                part = seg.sub(lo - seg.local_start, hi - seg.local_start)
                chunk.append(Segment(part.local_start - start, part.length, part.first, part.stride))
        return chunk

    @cached_property
    def kv_schedule(self):
        """The (double) ring schedule on which K, V blocks travel: rank r's queries meet the keys it
        holds. Steps end after the last one whose block pair the mask needs on some rank (a sliding
        window or local documents end the ring early, distflashattn.md App. D)."""
        return RingSchedule.build(
            self.rank,
            self.world,
            self.ranks_per_node,
            1,
            lambda r, src: may_attend(self.segments(r), self.segments(src), self.spec),
        )

    @cached_property
    def q_schedule(self):
        """The schedule on which query blocks travel (BurstAttention's backward): the opposite
        direction, so that the same block pairs meet in the same order as in kv_schedule."""
        return RingSchedule.build(
            self.rank,
            self.world,
            self.ranks_per_node,
            -1,
            lambda r, src: may_attend(self.segments(src), self.segments(r), self.spec),
        )

    @cached_property
    def ranks_per_node(self) -> int:
        """Ranks per node of this call's ring: the group's when the double ring applies (double_ring on, the
        group's ranks on several nodes, each node's consecutive: comm.topology.ranks_per_node), else the whole
        world (the flat ring)."""
        topo = self.topology
        if topo is None or not topo.double_ring or self.world == 1:
            return self.world
        return ranks_per_node(topo, self.group, self.world)
