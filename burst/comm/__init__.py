"""Communication: point-to-point exchange, ring with double buffering, and CommStats."""

from .p2p import OpLog, Transfer, exchange, global_rank, tagged
from .ring import RingComm
from .stats import CommStats, record_pairs, record_sent, tensor_bytes

__all__ = [
    "OpLog",
    "RingComm",
    "Transfer",
    "exchange",
    "global_rank",
    "tagged",
    "CommStats",
    "record_pairs",
    "record_sent",
    "tensor_bytes",
]
