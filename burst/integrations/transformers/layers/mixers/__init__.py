"""transformers' recurrent and convolutional sequence mixers, exact across ranks (state passing):
the names the rest of the package uses. families.py: FAMILIES and shard_mixers.
"""

from __future__ import annotations

from .families import FAMILIES, prepared, shard_mixers, supported

__all__ = ["FAMILIES", "prepared", "shard_mixers", "supported"]
