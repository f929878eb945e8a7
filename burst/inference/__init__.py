"""Long-context inference on a sharded KV cache: prefill keeps each rank's tokens, decode merges.

cache.py: ShardedKVCache (each rank's K, V, positions; decoded tokens appended in turn).
decode.py: decode_attention (partial attention on the shard + one all-gather + online-softmax merge).
"""

from .cache import ShardedKVCache
from .decode import decode_attention, merge_across_ranks, partial_attention

__all__ = ["ShardedKVCache", "decode_attention", "merge_across_ranks", "partial_attention"]
