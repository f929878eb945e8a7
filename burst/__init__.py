"""burst: exact attention over very long sequences split across devices.

Public names: attention, shard, unshard, CommStats (see DESIGN.md).
"""

from .api import attention
from .comm.stats import CommStats
from .layout import shard, unshard

__all__ = ["attention", "shard", "unshard", "CommStats"]
__version__ = "0.1.0"
