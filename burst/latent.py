"""Multi-head latent attention (MLA) across ranks: the latent travels, each rank expands what it holds.

MLA (DeepSeek-V2/V3/V3.2, Kimi, GLM-4.7-Flash/GLM-5, Mistral Large 4, MiniCPM3, ...) keeps one latent
per token, `kv_lora_rank` numbers (512 at DeepSeek-V3's shapes), plus one rotary key that every head
shares (`qk_rope_head_dim`, 64), and expands the latent with `kv_b_proj` into each head's non-rotary
key part (`qk_nope_head_dim`, 128) and value (`v_head_dim`, 128) right before attention. Expanded, a
token is heads x (nope + rope + v) numbers (128 x 320 at DeepSeek-V3's), 71 times its latent's 576.

So burst moves the latent on BurstAttention's key side (strategies/burst.py), forward and backward:
`LatentKeys` is a kind of key side (burst/keys.py), run by the same prepare_attention, Strategy and
autograd Function as K and V (their validation, sink fold and lse gradient). The (latent, rotary
key) blocks ride the ring (served chunk by chunk on one node), and the rank that computes with a
block expands it with the layer's weight (`LatentKeys.expand`), one chunk at a time, so that no
expanded block travels and on one node none exists whole. Backward: a held block's dK, dV (float32,
expanded, per chunk) fold back through the expansion's transpose before they go home,
    d latent = dK_nope W_k + dV W_v,    d rope = sum over heads of dK_rope,
and the weight's gradient dW += [dK_nope, dV]^T latent is each rank's sum over the blocks it expanded:
sum it over the group like any weight applied to this rank's tokens (bt.reduce_gradients does). Q, dO
and dQ stay home. Values are padded with zeros to the keys' width for the kernels (they take equal
head dims); the padding is dropped from the output and never travels.

    out = burst.attention(q, latent=burst.LatentKV(latent, rope, kv_b_proj.weight, nope_dim=128, value_dim=128),
                          causal=True)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .comm.stats import record_choice
from .kernels.accumulators import accumulator_zeros_like
from .keys import check_query, unit_stride_last
from .lse_channel import ones_after, zeros_after


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
        raise ValueError(
            f"LatentKV.rope must be (batch, seqlen_local, rope_dim) with nope_dim {nope} + rope_dim = "
            f"q's headdim {d}, got {tuple(latent.rope.shape)}"
        )
    if tuple(w.shape) != (h * (nope + vdim), c.shape[2]):
        raise ValueError(
            f"LatentKV.weight must be (nheads * (nope_dim + value_dim), rank) = ({h * (nope + vdim)}, "
            f"{c.shape[2]}), got {tuple(w.shape)}"
        )
    if vdim > d:
        raise ValueError(
            f"LatentKV.value_dim {vdim} is wider than q's headdim {d} (values are padded to the keys' width)"
        )
    if any(t.device != q.device for t in (c, rope, w)):
        raise ValueError(f"LatentKV's tensors must be on q's device {q.device}")


class LatentKeys:
    """The key side's blocks for MLA (a kind of burst/keys.py's key side): (latent, rope) travel, each
    held block is expanded with the weight, and its dK, dV fold back into latent gradients.

    given: the caller's LatentKV (checked by `check` before anything reads it). lse_channel: expanded
    blocks widened for lse's gradient (burst/lse_channel.py); the fold reads their first channels.
    """

    strategies = ("burst",)  # burst's ring and key-side backward move the latent

    def __init__(self, given: LatentKV, lse_channel: bool = False):
        self.given, self.lse_channel = given, lse_channel
        self.dweight: torch.Tensor | None = None  # float32, this rank's sum over the blocks it expanded
        self._weight32: torch.Tensor | None = None  # the weight in the accumulators' dtype, cast once

    def check(self, q) -> None:
        check_query(q)
        check_latent(self.given, q)

    def check_strategy(self, name: str, call) -> None:
        if name != "burst":
            raise ValueError(
                f"latent=: strategy {name!r} does not move MLA's latent; strategy='burst' does (its key side)"
            )
        if call.options.backward_side == "queries":
            raise ValueError(
                "latent=: burst's backward moves the latent (its key side); backward_side='queries' "
                "would move every expanded head's queries"
            )

    def check_entries(self, compressed, q, global_len: int) -> None:
        if compressed is not None:
            raise ValueError("latent= does not take compressed entries (not built: no MLA family uses them)")

    def kernel_value_dim(self, q) -> int:
        return q.shape[-1]  # values padded to the keys' width, which is q's

    def facts(self) -> dict:
        g = self.given
        return {
            "latent": (
                tuple(g.latent.shape),
                tuple(g.rope_rows().shape),
                tuple(g.weight.shape),
                g.nope_dim,
                g.value_dim,
            )
        }

    def ready(self, q) -> LatentKeys:
        """The latent, rotary key (b, m, dr) and weight in q's dtype, with unit-stride last dims."""
        record_choice("keys", "latent")  # CommStats.choices(): what this call moves on the key side
        g = self.given
        c, rope, w = (t.to(q.dtype) for t in (g.latent, g.rope_rows(), g.weight))
        return LatentKeys(replace(g, latent=unit_stride_last(c), rope=unit_stride_last(rope), weight=w))

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.given.latent, self.given.rope, self.given.weight

    def rebuilder(self):
        """LatentKeys from saved (latent, rope, weight), holding no tensor."""
        return functools.partial(_latent_from_inputs, self.given.nope_dim, self.given.value_dim)

    @property
    def travelling(self) -> list[torch.Tensor]:
        return [self.given.latent, self.given.rope]

    @property
    def value_width(self) -> int:
        return self.given.value_dim

    def with_lse_channel(self) -> LatentKeys:
        return LatentKeys(self.given, lse_channel=True)

    def narrow_gradients(self, grads):
        return grads  # the fold reads the widened blocks' first channels already

    def expand(self, held):
        """(latent (b, m, r), rope (b, m, dr)) -> k (b, m, h, nope + dr), v (b, m, h, nope + dr) zero-padded;
        with lse_channel both widened by burst/lse_channel.py's channels."""
        latent, rope = held
        nope, vdim, w = self.given.nope_dim, self.given.value_dim, self.given.weight
        b, m, _ = latent.shape
        heads = w.shape[0] // (nope + vdim)
        kv = F.linear(latent, w).view(b, m, heads, nope + vdim)
        k = torch.cat([kv[..., :nope], rope[:, :, None, :].expand(b, m, heads, rope.shape[-1])], dim=-1)
        v = F.pad(kv[..., nope:], (0, k.shape[-1] - vdim))
        return (zeros_after(k), ones_after(v)) if self.lse_channel else (k, v)

    def for_backward(self, held, acc_latent, acc_rope):
        k, v = self.expand(held)
        dk, dv = accumulator_zeros_like(k), accumulator_zeros_like(v)
        nope, vdim, dr = self.given.nope_dim, self.given.value_dim, held[1].shape[-1]

        def fold():  # the block's expanded gradients back through the expansion, then dropped
            into_latent = acc_latent() if callable(acc_latent) else acc_latent
            into_rope = acc_rope() if callable(acc_rope) else acc_rope
            latent = held[0]
            d_kv = torch.cat([dk[..., :nope], dv[..., :vdim]], dim=-1).flatten(2)  # (b, m, h*(nope+v))
            if self._weight32 is None:
                self._weight32 = self.given.weight.to(d_kv.dtype)
            into_latent += d_kv @ self._weight32
            into_rope += dk[..., nope : nope + dr].sum(dim=2)
            d_weight = d_kv.flatten(0, 1).t() @ latent.flatten(0, 1).to(d_kv.dtype)
            self.dweight = d_weight if self.dweight is None else self.dweight.add_(d_weight)

        return k, v, dk, dv, fold

    def gradients(self, accs):
        """(d latent, d rope, d weight) in their dtypes."""
        g = self.given
        dweight = (
            self.dweight
            if self.dweight is not None
            else torch.zeros(g.weight.shape, dtype=accs[0].dtype, device=g.weight.device)
        )
        return accs[0].to(g.latent.dtype), accs[1].to(g.rope.dtype), dweight.to(g.weight.dtype)


def _latent_from_inputs(nope_dim: int, value_dim: int, latent, rope, weight) -> LatentKeys:
    return LatentKeys(LatentKV(latent, rope, weight, nope_dim, value_dim))
