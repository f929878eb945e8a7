"""A LLaMA-style decoder in plain PyTorch: RMSNorm, rotary embeddings, SwiGLU, GQA.

Sequence parallelism enters from outside (torchtitan's habit): every attention layer calls its
`attend(q, k, v)`, single-device SDPA by default; `parallelize(model, group, strategy, layout)`
swaps in burst.attention over the sequence-parallel group. Rotary embeddings take each token's
*global* position (the layout's, from burst.layout.shard_indices), so a zigzag or striped shard is
rotated exactly as the whole sequence would be. The model returns the final hidden states; the LM
head's weight goes to the fused loss (engine/loss.py), so the N x V logits are never built.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..agreement import agree_on_weights
from ..plan.models import PRESETS, ModelConfig  # noqa: F401 - burst.engine.model.PRESETS, read by the engine's callers
from .checkpointing import SequenceAttention, check_settings, run_layer
from .loss import fused_linear_cross_entropy, unfused_cross_entropy


def rotary(positions: torch.Tensor, head_dim: int, theta: float, scaling=None):
    """cos, sin of shape (batch, seq, 1, head_dim / 2) for the given global positions (batch, seq);
    scaling: a plan.models.Llama3RopeScaling (Llama 3.1's frequencies), or None."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    if scaling is not None:
        freqs = llama3_frequencies(freqs, scaling)
    angles = positions.to(torch.float64)[..., None] * freqs
    return torch.cos(angles)[:, :, None].float(), torch.sin(angles)[:, :, None].float()


def llama3_frequencies(freqs: torch.Tensor, s) -> torch.Tensor:
    """Llama 3.1's scaled rotary frequencies (Meta's apply_scaling; transformers' "llama3" rope type)."""
    wavelen = 2 * math.pi / freqs
    low_wavelen = s.original_max_positions / s.low_freq_factor  # longer than this: stretched by factor
    high_wavelen = s.original_max_positions / s.high_freq_factor  # shorter than this: kept
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    between = (1 - smooth) * freqs / s.factor + smooth * freqs
    return torch.where(wavelen > low_wavelen, freqs / s.factor, torch.where(wavelen < high_wavelen, freqs, between))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)  # low precision rotates in float32
    x1, x2 = x[..., 0::2].to(acc), x[..., 1::2].to(acc)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)


class _Rotary(torch.autograd.Function):
    """Rotary embedding whose backward rotates the gradient back (by -angle): it saves cos and sin
    only, where autograd through _rotate would keep the unrotated q and k of every token."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim) rotated pairwise by the angles of cos, sin (rotary())."""
    if not (torch.is_grad_enabled() and x.requires_grad):  # inference: no autograd node to pay for
        return _rotate(x, cos, sin)
    return _Rotary.apply(x, cos, sin)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * rsqrt(mean(x^2) + eps) * weight, the rsqrt per row); low precision normalizes in float32."""
    acc = torch.promote_types(x.dtype, torch.float32)
    rstd = torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)
    return (x.to(acc) * rstd).to(x.dtype) * weight, rstd


class _RMSNormFunction(torch.autograd.Function):
    """_rms_norm saving x and one float per row: autograd through the formula would also keep the
    normalized x, a second copy of the input per norm."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        out, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd
        grad_weight = (grad * normed.to(x.dtype)).reshape(-1, weight.shape[0]).sum(0).to(weight.dtype)
        grad_normed = (grad * weight).to(rstd.dtype)
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if torch.is_grad_enabled():
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)[0]  # inference: no autograd node to pay for


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)
        self.attend = SequenceAttention(world=1)  # parallelize() makes it burst.attention over a group

    def project(self, x, cos, sin):
        """q (batch, seq, heads, head_dim), k, v (batch, seq, kv_heads, head_dim), rotated."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, attend=None):
        """attend: this call's attention (checkpointing's StoredAttention), default self.attend."""
        q, k, v = self.project(x, cos, sin)
        return self.wo((attend or self.attend)(q, k, v).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU. `chunk` > 0 runs it over that many tokens at a time (RingAttention's blockwise
    feedforward): each chunk under its own checkpoint, so that the backward holds the (tokens x
    ffn_dim) hidden activations of one chunk at a time, not of every chunk (autograd saves 4 ffn_dim-wide
    tensors per token: 10.75 KiB in fp32 at ffn_dim 688, against 1 KiB for the layer's input). The
    price is one more forward of the feedforward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.chunk = 0

    def _swiglu(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x):
        if not self.chunk or x.shape[1] <= self.chunk:
            return self._swiglu(x)
        swiglu = self._swiglu
        if torch.is_grad_enabled():
            swiglu = functools.partial(checkpoint, self._swiglu, use_reentrant=False)
        return torch.cat([swiglu(part) for part in x.split(self.chunk, dim=1)], dim=1)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, attend=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, attend)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """cfg's decoder. device="meta" builds the shapes without memory (an 8B model's checks on a
    laptop); `to_empty(device=...)` then reset_parameters() gives it weights (engine/train.py's build)."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.cfg = cfg
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.checkpointing, self.checkpoint_split = "none", 0.5  # see engine/checkpointing.py
        self.offload_activations = False  # what checkpointing keeps, held in host memory (engine/offload.py)
        self.offload_layers = 0  # with it: the first N layers' only (0: every layer's)
        self.reset_parameters()

    def reset_parameters(self):
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(
                    module.weight,
                    std=0.02 if isinstance(module, nn.Embedding) else 1 / math.sqrt(module.weight.shape[1]),
                )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_group=None,
        fused_loss: bool = True,
    ) -> torch.Tensor:
        """tokens, positions: (batch, seq) (this rank's shard and its global positions) -> hidden
        states (batch, seq, dim) after the final norm; with `targets` (batch, seq), the mean
        cross-entropy instead (this rank's share of the global mean over `loss_group`), by the fused
        LM head + loss (engine/loss.py) or, with fused_loss=False, through the full logits. The loss
        is taken inside forward so that FSDP2 has the LM head's weight unsharded."""
        cos, sin = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        x = self.embed(tokens)
        offloaded = (self.offload_layers or len(self.blocks)) if self.offload_activations else 0
        for i, block in enumerate(self.blocks):
            x = run_layer(block, x, cos, sin, positions, self.checkpointing, self.checkpoint_split, i < offloaded)
        hidden = self.norm(x)
        if targets is None:
            return hidden
        if fused_loss:
            return fused_linear_cross_entropy(hidden, self.lm_head.weight, targets, group=loss_group)
        return unfused_cross_entropy(self.lm_head(hidden), targets, group=loss_group)

    def set_checkpointing(
        self, mode: str = "none", split: float = 0.5, ffn_chunk: int = 0, offload: bool = False, offload_layers: int = 0
    ) -> "Transformer":
        """Activation checkpointing (engine/checkpointing.py: none | full | remat | selective; `split`
        is the fraction of the sequence `selective` recomputes), the blockwise feedforward
        (`ffn_chunk` tokens at a time; 0 = whole), and `offload`: what checkpointing keeps per layer
        held in host memory between forward and backward (engine/offload.py), for the first
        `offload_layers` layers only when that is not 0 (the rest keep theirs on the device)."""
        check_settings(mode, split, ffn_chunk, offload, offload_layers)
        if offload_layers > len(self.blocks):
            raise ValueError(f"offload layers {offload_layers}: the model has {len(self.blocks)} layers")
        self.checkpointing, self.checkpoint_split, self.offload_activations = mode, split, offload
        self.offload_layers = offload_layers
        for block in self.blocks:
            block.feed_forward.chunk = ffn_chunk
        return self


def parallelize(model: Transformer, group=None, strategy: str = "burst", layout: str = "zigzag", **options):
    """Make every attention layer sequence-parallel over `group` (burst.attention, causal). Every rank of the
    group must hold the same weights: checked at the model's first forward (weights loaded after this count)."""
    attend = SequenceAttention(group=group, strategy=strategy, layout=layout, **options)
    if attend.world > 1:
        _agree_on_weights_at_first_forward(model, group, attend.world)
    for block in model.blocks:
        block.attention.attend = attend
    return model


def _agree_on_weights_at_first_forward(model: nn.Module, group, world: int) -> None:
    def check(module, args):
        agree_on_weights(module, group, world, "burst.engine.parallelize (at the model's first forward)")
        handle.remove()  # kept while refused: the next forward checks again

    handle = model.register_forward_pre_hook(check)
