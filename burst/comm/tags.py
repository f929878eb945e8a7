"""Message tags of every point-to-point loop, in one table.

gloo matches a receive to a send by (peer, tag), so two transfers in flight at once between the same
two ranks need different tags; NCCL matches by issue order, which our loops keep the same on every
rank. A transfer of several tensors uses tag, tag + 1, ... (one per tensor), so each base below leaves
room for the largest set its loop sends. Only one strategy's loop runs at a time, so strategies may
reuse each other's numbers; within a loop they must not overlap.
"""

# The (double) ring (strategies/ring.py): blocks around the node, blocks across nodes, accumulators.
RING_INTRA, RING_INTER, RING_ACCUMULATORS = 0, 8, 16

# BurstAttention's owner-served chunk stream (strategies/burst_stream.py): key chunks (k, v) forward, or
# query chunks (q, dO, D, lse) and their dQ chunks going home backward. Apart from the ring's: a call
# may run the ring forward and the stream backward.
STREAM_CHUNKS, STREAM_ACCUMULATORS = 24, 32

# DistFlashAttn (strategies/distflash.py): K, V; a helped rank's query rows and their extras (q, dO, D,
# lse); results back (out, lse forward; dK, dV and dQ backward).
DISTFLASH_KV, DISTFLASH_QUERIES, DISTFLASH_RESULTS = 0, 2, 8

# CQS (strategies/cqs.py): query-side materials (q, dO, D, lse), key-side (k, v); results back: out,
# lse or dQ, and dK, dV.
CQS_QUERIES, CQS_KV, CQS_RESULTS, CQS_KV_RESULTS = 0, 4, 8, 12
