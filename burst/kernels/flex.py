"""FlexAttention backend (torch.nn.attention.flex_attention): any mask as a rule, never as a bias.

For CUDA tiles that flash_attn cannot take (block-sparse masks, runs of unequal strides, fp32), for
softcap, and wherever BURST_KERNEL=flex asks. Without flash_attn the default CUDA kernel is aten's
efficient op (cuda_sdpa.py), not this one: on an H200 the compiled flex_attention recompiled per tile
shape, dtype and grad mode until dynamo's recompile limit sent it to the unfused path
(benchmarks/gpu.md). The tile's mask reaches it as a rule over global positions (masks.PositionRule),
as bands (masks.Bands) or as a dense bool tensor; each becomes a `mask_mod`, and the `BlockMask` built
from it (once per plan and device, cached) lets the kernel skip the blocks the mask leaves out.

Forward: `flex_attention(..., return_aux=AuxRequest(lse=True))` (natural-log lse, -inf and out 0 for a
row with no key, as burst's merge wants).

Backward with the rows' *global* out and lse (ring backward). FlexAttention has no entry point that
takes them, so the tile's forward is recomputed under autograd and differentiated with weighted
incoming gradients. With w = exp(lse_tile - lse_global) per row (0 for a globally empty row) and
D = rowsum(dout * out_global):
    grad of out_tile = w * dout,    grad of lse_tile = w * (rowsum(dout * out_tile) - D).
Then dS = P_tile * w * (dout . v_j - D) = P_global * (dP - D): the global softmax's gradient, exactly
what flash_attn's backward computes from the global out and lse. The suite checks this algebra
against float64 with a differentiable stand-in of flex_attention (torch on the CPU has no
FlexAttention backward) and the forward against the real one on the CPU; scripts/gpu_check.sh ran
it on an H200, exact (benchmarks/gpu.md).

On CUDA, flex_attention is compiled (torch.compile) as its documentation asks; eager it runs a slow
reference implementation.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..masks import Bands, PositionRule
from .masking import dense_mask
from .spec import HALF, KernelSpec

MAX_ROWS = 8192
SOFTCAP = True  # forward and backward take softcap= (a score_mod)
RULES = True  # takes partial tiles whole, as rules (masks.TileSizes.rules); bands from flash_attn's fallback too


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when this torch has FlexAttention with the lse output burst needs."""
    try:
        module = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return False
    return all(hasattr(module, name) for name in ("AuxRequest", "create_block_mask", "flex_attention"))


# auto: softcap only (compiled, it recompiled per tile shape on an H200 until dynamo's limit: benchmarks/gpu.md)
SPEC = KernelSpec(
    "flex",
    "cuda",
    (*HALF, torch.float32),
    available=lambda: available(),
    missing=f"this torch ({torch.__version__}) has no FlexAttention with lse output",
    auto="softcap",
)


@functools.lru_cache(maxsize=None)
def _compiled(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=None: after a second tile shape dynamo compiles for dynamic shapes instead of one graph per shape
    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


def _position_mod(rule: PositionRule, device):
    """mask_mod(b, h, q_idx, kv_idx) of a tile's rule: each row's global position (and document)
    looked up, then MaskSpec.attends, the one statement of what the mask allows."""
    q_pos, k_pos = rule.q.positions(device), rule.k.positions(device)
    q_doc, k_doc = rule.spec.documents(q_pos, k_pos)

    def mask_mod(b, h, q_idx, kv_idx):
        return rule.spec.attends(
            q_pos[q_idx],
            k_pos[kv_idx],
            q_doc[q_idx] if q_doc is not None else None,
            k_doc[kv_idx] if k_doc is not None else None,
        )

    return mask_mod


def _bands_mod(bands: Bands, device):
    """mask_mod of a tile's bands: Bands.attends on per-row lookups built once."""
    rows = bands.rows(device)
    return lambda b, h, q_idx, kv_idx: bands.attends(q_idx, kv_idx, rows)


def _mask_mod(mask, causal: bool, device):
    if isinstance(mask, PositionRule):
        return _position_mod(mask, device)
    if isinstance(mask, Bands):
        return _bands_mod(mask, device)
    if mask is not None:  # a dense mask: looked up, still never widened to a bias
        allowed = dense_mask(mask, device)
        if allowed.dim() == 4:  # an index selection: one mask per batch row, (batch, 1, sq, sk)
            return lambda b, h, q_idx, kv_idx: allowed[b, 0, q_idx, kv_idx]
        return lambda b, h, q_idx, kv_idx: allowed[q_idx, kv_idx]
    if causal:
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    return None


_BLOCK_MASKS: dict = {}  # (mask, causal, sq, sk, device) -> BlockMask; masks are the plan's, cached with it
_BLOCK_MASKS_MAX = 512


def _block_mask(mask, causal: bool, sq: int, sk: int, device):
    key = (id(mask) if mask is not None else None, causal, sq, sk, str(device))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]
    mod = _mask_mod(mask, causal, device)
    if mod is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    batch = mask.shape[0] if isinstance(mask, torch.Tensor) and mask.dim() == 4 else None
    block_mask = create_block_mask(mod, batch, None, sq, sk, device=device)
    if len(_BLOCK_MASKS) >= _BLOCK_MASKS_MAX:
        _BLOCK_MASKS.clear()
    _BLOCK_MASKS[key] = (mask, block_mask)  # the mask object kept alive, so its id is not reused
    return block_mask


@functools.lru_cache(maxsize=16)
def _softcap_mod(softcap: float):
    """score_mod of logit softcapping: FlexAttention applies it to the scaled score, as Gemma 2 does."""
    return lambda score, b, h, q_idx, kv_idx: softcap * torch.tanh(score / softcap)


def _attend(q, k, v, scale: float, block_mask, softcap: float = 0.0):
    """(b, s, h, d) in, FlexAttention's (b, h, s, d) layout inside; out (b, sq, h, d), lse (b, h, sq)."""
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = _compiled(q.device.type)(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=block_mask,
        scale=scale,
        score_mod=_softcap_mod(softcap) if softcap else None,
        enable_gqa=q.shape[2] != k.shape[2],
        return_aux=AuxRequest(lse=True),
    )
    return out.transpose(1, 2), aux.lse


def forward(
    q, k, v, scale: float, causal: bool, mask: torch.Tensor | Bands | PositionRule | None = None, softcap: float = 0.0
):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32 (float64 for float64)."""
    block_mask = _block_mask(mask, causal, q.shape[1], k.shape[1], q.device)
    out, lse = _attend(q, k, v, scale, block_mask, softcap)
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    scale: float,
    causal: bool,
    mask: torch.Tensor | Bands | PositionRule | None = None,
    softcap: float = 0.0,
):
    """Gradients of one block given the rows' global out and lse (see the module docstring)."""
    block_mask = _block_mask(mask, causal, q.shape[1], k.shape[1], q.device)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out_tile, lse_tile = _attend(qq, kk, vv, scale, block_mask, softcap)  # autograd: tanh's derivative too
        weight = torch.exp(lse_tile.to(acc) - lse.to(acc))  # (b, h, sq); 0 where either lse is -inf / +inf
        weight = torch.nan_to_num(weight, nan=0.0)  # a row empty both here and globally
        delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # D, (b, h, sq)
        own = (dout.to(acc) * out_tile.to(acc)).sum(-1).transpose(1, 2)  # rowsum(dout * out_tile)
        grad_out = (dout.to(acc) * weight.transpose(1, 2)[..., None]).to(out_tile.dtype)
        grad_lse = (weight * (own - delta)).to(lse_tile.dtype)
        dq, dk, dv = torch.autograd.grad((out_tile, lse_tile), (qq, kk, vv), (grad_out, grad_lse))
    return dq, dk, dv
