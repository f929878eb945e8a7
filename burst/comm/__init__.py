"""Communication: ring exchange with double buffering, and CommStats."""

from .ring import RingComm
from .stats import CommStats, record_pairs, record_sent, tensor_bytes

__all__ = ["RingComm", "CommStats", "record_pairs", "record_sent", "tensor_bytes"]
