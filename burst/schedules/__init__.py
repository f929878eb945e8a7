"""Schedules: who holds which block when, for each strategy. Plans only, no process group: each is
run by its strategy's loop (strategies/), which moves the blocks with comm/.

    ring.py          the (double) ring: RingAttention, BurstAttention (burstengine.md §3.1)
    chunk_stream.py  BurstAttention's backward on one node, chunk by chunk from the owners
    distflash.py     DistFlashAttn's load-balanced causal schedule (distflashattn.md Alg. 2)
    cqs.py           CQS-Attention's cyclic quorums and distilled schedule (cqs-attention.md)
    cqs_paper.py     the CQS paper's own token-level lists (Tables 1-2)
"""
