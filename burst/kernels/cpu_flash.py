"""CPU backend: aten's flash attention for CPU (forward and backward), GQA native from torch 2.10.

It runs near the machine's matmul speed and returns logsumexp; float16 tiles run in float32
(COMPUTED_IN_FLOAT32: the op's own float16 path was ~12x slower). Its `attn_mask` must be a float
additive mask of the query's dtype; a fully masked row comes back as out 0 with lse 0, which we
correct to lse -inf so merges ignore it (masking.clear_empty_rows).

Before GQA_FROM the op reads K and V as if they had the query's heads: handed fewer, it reads past
their storage and corrupts the heap (a crash or wrong numbers; seen on torch 2.4, 2.6 and 2.8). There the KV
heads are repeated to the query's count, and their gradients summed back. burst refuses those releases
at import (torch_floor.py) unless BURST_ALLOW_OLD_TORCH=1; this keeps them exact then.
"""

from __future__ import annotations

import torch

from .heads import repeated_kv, summed_kv
from .masking import additive_mask, clear_empty_rows, dense_mask
from .spec import FLOATS, KernelSpec

# Rows per call at most: the op returns fresh out/dq/dk/dv per call, so smaller calls hold less, and
# on CPU 1024-row calls run as fast as 4096-row ones (measured, 1 thread, 8 heads, dim 64).
MAX_ROWS = 1024
# Masked tiles and causal triangles are halved down to 64-row leaves (masks.TileSizes): this op's
# causal path costs about a whole square up to 512 rows (2.0x a full pair per attended pair) and 1.46x
# at 1024; halved to 64-row leaves a 1024-row triangle costs 1.11x, a 256-row one 1.53x (1 thread,
# 8 heads, dim 64, fwd + bwd: benchmarks/triangle_leaves.py, table in benchmarks/masks.md).
LEAF_ROWS = 64
SPLITS_TRIANGLES = True
# The least rows of a served chunk (schedules/chunk_stream.default_chunk_rows), by dtype, above MAX_ROWS: aten's
# bf16 backward costs 1.35x per attended pair at 256 rows and 1.30x at 512 against 1024 (1 thread, 8 heads, dim
# 64; fp32 at most 1.19x, unseen end to end), and with 1024-row chunks a causal zigzag backward still took
# 1.09-1.14x ring's, with 2048 (two calls each) 0.99-1.03x (benchmarks/small_shards.md, bf16).
MIN_CHUNK_ROWS_BY_DTYPE = {torch.bfloat16: 2048}  # float16 runs as float32 (COMPUTED_IN_FLOAT32 below)
SOFTCAP = False
SPEC = KernelSpec("cpu_flash", "cpu", FLOATS)
GQA_FROM = "2.10"  # the first torch whose op takes fewer KV heads than query heads
GQA_NATIVE = torch.torch_version.TorchVersion(torch.__version__) >= GQA_FROM
# The op ran float16 ~12x slower than float32 (backward, 1K query rows x 2K keys, 1 thread: 1.44 s against 0.117 s,
# measured on one AMD EPYC with AVX-512 BF16 but no FP16 arithmetic); a float16 tile is computed in float32 on every
# CPU and handed back in float16, as the op's own results are (the casts cost rows x dim, the op rows x keys x
# dim). bfloat16 runs as it comes (faster than float32 there).
COMPUTED_IN_FLOAT32 = torch.float16
_forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def forward(q, k, v, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32."""
    if q.dtype == COMPUTED_IN_FLOAT32:
        out, lse = forward(q.float(), k.float(), v.float(), scale, causal, mask)
        return out.to(COMPUTED_IN_FLOAT32), lse
    mask = dense_mask(mask, q.device)
    k, v = (k, v) if GQA_NATIVE else repeated_kv(k, v, q.shape[2])
    out, lse = _forward_op(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        0.0,
        causal,
        attn_mask=additive_mask(mask, q.dtype),
        scale=scale,
    )
    return clear_empty_rows(out.transpose(1, 2), lse, mask)


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """Gradients of one block given the rows' global out and lse (see kernels/__init__.py)."""
    if q.dtype == COMPUTED_IN_FLOAT32:
        grads = backward(*(t.float() for t in (dout, q, k, v, out)), lse, scale, causal, mask)
        return tuple(g.to(COMPUTED_IN_FLOAT32) for g in grads)
    mask = dense_mask(mask, q.device)
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)  # what the op expects
    kv_heads = k.shape[2]
    k, v = (k, v) if GQA_NATIVE else repeated_kv(k, v, q.shape[2])
    dq, dk, dv = _backward_op(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse,
        0.0,
        causal,
        attn_mask=additive_mask(mask, q.dtype),
        scale=scale,
    )
    return dq.transpose(1, 2), summed_kv(dk.transpose(1, 2), kv_heads), summed_kv(dv.transpose(1, 2), kv_heads)
