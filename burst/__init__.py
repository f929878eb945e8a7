"""burst: exact attention over very long sequences split across devices.

Public names: attention, shard, unshard, CommStats, BlockSparseMask, set_agreement_check, check,
Topology (see DESIGN.md); also set_agreement_timeout, context_parallel, DocumentLayout, CompressedKV
and LatentKV.
"""

import torch as _torch

from .torch_floor import check_torch as _check_torch

_check_torch(_torch.__version__)

from . import cqs  # noqa: F401 - burst.cqs.interest_set (the CQS paper's interest set) is public
from .agreement import set_agreement_check, set_agreement_timeout
from .api import attention
from .check import check
from .comm.stats import CommStats
from .comm.topology import Topology
from .compressed import CompressedKV
from .context_parallel import context_parallel
from .latent import LatentKV
from .layout import DocumentLayout, shard, unshard
from .masks import BlockIndices, BlockSparseMask

__all__ = [
    "attention",
    "shard",
    "unshard",
    "CommStats",
    "BlockIndices",
    "BlockSparseMask",
    "set_agreement_check",
    "set_agreement_timeout",
    "check",
    "Topology",
    "context_parallel",
    "DocumentLayout",
    "CompressedKV",
    "LatentKV",
]
__version__ = "0.3.14"
