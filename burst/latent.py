"""Multi-head latent attention (MLA) across ranks: the latent travels, each rank expands what it holds.

MLA (DeepSeek-V2/V3/V3.2, Kimi, GLM-4.7-Flash/GLM-5, Mistral Large 4, MiniCPM3, ...) keeps one latent
per token, `kv_lora_rank` numbers (512 at DeepSeek-V3's shapes), plus one rotary key that every head
shares (`qk_rope_head_dim`, 64), and expands the latent with `kv_b_proj` into each head's non-rotary
key part (`qk_nope_head_dim`, 128) and value (`v_head_dim`, 128) right before attention. Expanded, a
token is heads x (nope + rope + v) numbers (128 x 320 at DeepSeek-V3's), 71 times its latent's 576.

So burst moves the latent on BurstAttention's key side (strategies/burst.py), forward and backward:
the (latent, rotary key) blocks ride the ring (served chunk by chunk on one node), and the rank that
computes with a block expands it with the layer's weight (`LatentKeys.expand`), one chunk at a time,
so that no expanded block travels and on one node none exists whole. Backward: a held block's dK, dV
(float32, expanded, per chunk) fold back through the expansion's transpose before they go home,
    d latent = dK_nope W_k + dV W_v,    d rope = sum over heads of dK_rope,
and the weight's gradient dW += [dK_nope, dV]^T latent is each rank's sum over the blocks it expanded:
sum it over the group like any weight applied to this rank's tokens (bt.reduce_gradients does). Q, dO
and dQ stay home. Values are padded with zeros to the keys' width for the kernels (they take equal
head dims); the padding is dropped from the output and never travels.

    out = burst.attention(q, latent=burst.LatentKV(latent, rope, kv_b_proj.weight, nope_dim=128, value_dim=128),
                          causal=True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .comm.stats import record_choice
from .kernels.accumulators import accumulator_zeros_like
from .lse_channel import dlse_after, narrowed, ones_after, zeros_after
from .sinks import fold_sinks, sink_gradient


@dataclass(frozen=True, eq=False)
class LatentKV:
    """MLA's keys and values as their latent: what burst.attention(q, latent=...) moves instead of K, V.

    latent: (batch, seqlen_local, kv_lora_rank), this rank's shard (after the layer's kv_a_layernorm).
    rope: (batch, seqlen_local, rope_dim) or (batch, seqlen_local, 1, rope_dim), the rotary key every
        head shares, already rotated.
    weight: (nheads * (nope_dim + value_dim), kv_lora_rank), the expansion (kv_b_proj.weight): head h's
        rows are its nope_dim key rows, then its value_dim value rows.
    nope_dim, value_dim: each head's non-rotary key width and value width. q is (batch, seqlen_local,
        nheads, nope_dim + rope_dim); the output is (batch, seqlen_local, nheads, value_dim).
    Differentiable in latent, rope and weight (the weight's gradient: this rank's share).
    """

    latent: torch.Tensor
    rope: torch.Tensor
    weight: torch.Tensor
    nope_dim: int
    value_dim: int

    def rope_rows(self) -> torch.Tensor:
        """rope as (batch, seqlen_local, rope_dim)."""
        return self.rope.squeeze(2) if self.rope.dim() == 4 else self.rope


def check_latent(latent, q: torch.Tensor) -> None:
    """ValueError / TypeError unless `latent` is a LatentKV that fits q. Local facts only."""
    if not isinstance(latent, LatentKV):
        raise TypeError(f"latent must be a burst.LatentKV, got {type(latent).__name__}")
    c, rope, w = latent.latent, latent.rope_rows(), latent.weight
    if not all(isinstance(t, torch.Tensor) for t in (c, rope, w)):
        raise TypeError("LatentKV.latent, .rope and .weight must be tensors")
    for name in ("nope_dim", "value_dim"):
        value = getattr(latent, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"LatentKV.{name} must be a positive int, got {value!r}")
    b, n, h, d = q.shape
    nope, vdim = latent.nope_dim, latent.value_dim
    if c.dim() != 3 or tuple(c.shape[:2]) != (b, n):
        raise ValueError(f"LatentKV.latent must be (batch, seqlen_local, rank) = ({b}, {n}, r), got {tuple(c.shape)}")
    if rope.dim() != 3 or tuple(rope.shape[:2]) != (b, n) or nope + rope.shape[2] != d:
        raise ValueError(f"LatentKV.rope must be (batch, seqlen_local, rope_dim) with nope_dim {nope} + rope_dim = "
                         f"q's headdim {d}, got {tuple(latent.rope.shape)}")
    if tuple(w.shape) != (h * (nope + vdim), c.shape[2]):
        raise ValueError(f"LatentKV.weight must be (nheads * (nope_dim + value_dim), rank) = ({h * (nope + vdim)}, "
                         f"{c.shape[2]}), got {tuple(w.shape)}")
    if vdim > d:
        raise ValueError(f"LatentKV.value_dim {vdim} is wider than q's headdim {d} (values are padded to the keys' width)")
    if any(t.device != q.device for t in (c, rope, w)):
        raise ValueError(f"LatentKV's tensors must be on q's device {q.device}")


class LatentKeys:
    """The key side's blocks for MLA (a strategies.base.KeyBlocks): (latent, rope) travel, each held
    block is expanded with the weight, and its dK, dV fold back into latent gradients."""

    def __init__(self, latent: torch.Tensor, rope: torch.Tensor, weight: torch.Tensor, nope_dim: int, value_dim: int,
                 lse_channel: bool = False):
        self.weight, self.nope, self.vdim, self.lse_channel = weight, nope_dim, value_dim, lse_channel
        self.heads = weight.shape[0] // (nope_dim + value_dim)
        self.travelling = [latent, rope]
        self.dweight: torch.Tensor | None = None  # float32, this rank's sum over the blocks it expanded
        self._weight32: torch.Tensor | None = None  # the weight in the accumulators' dtype, cast once

    def expand(self, held):
        """(latent (b, m, r), rope (b, m, dr)) -> k (b, m, h, nope + dr), v (b, m, h, nope + dr) zero-padded;
        with lse_channel both widened by burst/lse_channel.py's channels (lse's gradient)."""
        latent, rope = held
        b, m, _ = latent.shape
        kv = F.linear(latent, self.weight).view(b, m, self.heads, self.nope + self.vdim)
        k = torch.cat([kv[..., :self.nope], rope[:, :, None, :].expand(b, m, self.heads, rope.shape[-1])], dim=-1)
        v = F.pad(kv[..., self.nope:], (0, k.shape[-1] - self.vdim))
        return (zeros_after(k), ones_after(v)) if self.lse_channel else (k, v)

    def for_backward(self, held, acc_latent, acc_rope):
        k, v = self.expand(held)
        dk, dv = accumulator_zeros_like(k), accumulator_zeros_like(v)

        def fold():  # the block's expanded gradients back through the expansion, then dropped
            into_latent = acc_latent() if callable(acc_latent) else acc_latent
            into_rope = acc_rope() if callable(acc_rope) else acc_rope
            latent = held[0]
            d_kv = torch.cat([dk[..., :self.nope], dv[..., :self.vdim]], dim=-1).flatten(2)  # (b, m, h*(nope+v))
            if self._weight32 is None:
                self._weight32 = self.weight.to(d_kv.dtype)
            into_latent += d_kv @ self._weight32
            into_rope += dk[..., self.nope:self.nope + held[1].shape[-1]].sum(dim=2)
            d_weight = d_kv.flatten(0, 1).t() @ latent.flatten(0, 1).to(d_kv.dtype)
            self.dweight = d_weight if self.dweight is None else self.dweight.add_(d_weight)

        return k, v, dk, dv, fold

    def gradients(self, accs):
        """(d latent, d rope, d weight), float32."""
        dweight = self.dweight if self.dweight is not None else torch.zeros(self.weight.shape, dtype=accs[0].dtype,
                                                                           device=self.weight.device)
        return accs[0], accs[1], dweight


class LatentAttentionFunction(torch.autograd.Function):
    """BurstAttention over MLA's latent: burst's forward and key-side backward (strategies/burst.py)
    with LatentKeys as what travels. Returns out (b, n, h, value_dim) in q's dtype and lse."""

    @staticmethod
    def forward(ctx, q, latent, rope, weight, sinks, call, nope_dim: int, value_dim: int):
        from .strategies.burst import burst_forward

        record_choice("keys", "latent")  # CommStats.choices(): what this call moved on the key side
        out, lse = burst_forward(call, q, None, None, LatentKeys(latent, rope, weight, nope_dim, value_dim))
        if sinks is not None:  # folded into the finished rows, as for any strategy (strategies/base.py)
            out, lse = fold_sinks(out, lse, sinks)
        ctx.save_for_backward(q, latent, rope, weight, sinks, out, lse)
        ctx.call, ctx.dims = call, (nope_dim, value_dim)
        ctx.set_materialize_grads(False)  # dlse None when lse is not read
        return out[..., :value_dim], lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from .strategies.burst import key_side_backward

        q, latent, rope, weight, sinks, out, lse = ctx.saved_tensors
        nope_dim, value_dim = ctx.dims
        # the padding's gradient is zero
        dout = torch.zeros_like(out) if dout is None else F.pad(dout, (0, out.shape[-1] - value_dim)).contiguous()
        keys = LatentKeys(latent, rope, weight, nope_dim, value_dim, lse_channel=dlse is not None)
        if dlse is None:
            dq, d_latent, d_rope, d_weight = key_side_backward(ctx.call, dout, q, keys, out, lse)
        else:  # burst/lse_channel.py
            dq, d_latent, d_rope, d_weight = key_side_backward(ctx.call, dlse_after(dout, dlse), zeros_after(q), keys,
                                                               zeros_after(out), lse)
            dq = narrowed(dq, q)
        d_sinks = sink_gradient(dout, out, lse, sinks, dlse) if sinks is not None and ctx.needs_input_grad[4] else None
        return (dq, d_latent.to(latent.dtype), d_rope.to(rope.dtype), d_weight.to(weight.dtype), d_sinks,
                None, None, None)


def latent_attention(call, q: torch.Tensor, latent: LatentKV, sinks: torch.Tensor | None = None):
    """(out, lse) of q against the keys and values `latent` expands to (and the sinks, burst/sinks.py),
    for a prepared call."""
    c, rope, w = (t.to(q.dtype) for t in (latent.latent, latent.rope_rows(), latent.weight))
    c, rope = (t if t.stride(-1) == 1 else t.contiguous() for t in (c, rope))
    return LatentAttentionFunction.apply(q, c, rope, w, sinks, call, latent.nope_dim, latent.value_dim)
