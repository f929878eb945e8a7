"""Masks: which (query, key) pairs attend, and the kernel calls that compute a block pair under them.

    rules.py    what attends: MaskSpec (causal, window, documents, BlockSparseMask), its Cover of a
                pair of position runs, PositionRule (a tile's mask as a rule), may_attend
    bands.py    a tile's mask as kernel arguments (Bands: flash_attn's window and varlen)
    tiles.py    what a kernel gets: Tile (one call) and TileSizes (how a kernel wants its calls)
    planner.py  plan_tiles: a block pair cut into tiles
    selection.py  index selections (each query's chosen keys), applied on top of the planned tiles

Imports run one way: planner -> tiles -> bands -> rules. This module only re-exports their names.
The planner's tuning constant TILE lives in planner.py: set `burst.masks.planner.TILE` to change it.
"""

from .bands import Bands
from .planner import RULE_CHECK, TILE, plan_tiles
from .rules import BlockSparseMask, Cover, MaskSpec, PositionRule, may_attend
from .selection import BlockIndices, checked_selection, selected
from .tiles import MAX_TILE, SUB_TILE, Tile, TileSizes

__all__ = [
    "Bands",
    "BlockIndices",
    "BlockSparseMask",
    "Cover",
    "MaskSpec",
    "MAX_TILE",
    "PositionRule",
    "RULE_CHECK",
    "SUB_TILE",
    "checked_selection",
    "TILE",
    "Tile",
    "TileSizes",
    "may_attend",
    "plan_tiles",
    "selected",
]
