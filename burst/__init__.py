"""burst: exact attention over very long sequences split across devices.

Public names: attention, shard, unshard, CommStats, BlockSparseMask, set_agreement_check, check (see DESIGN.md).
"""

from .agreement import set_agreement_check
from .api import attention
from .comm.stats import CommStats
from .layout import shard, unshard
from .masks import BlockSparseMask
from .parity import check

__all__ = ["attention", "shard", "unshard", "CommStats", "BlockSparseMask", "set_agreement_check", "check"]
__version__ = "0.1.0"
