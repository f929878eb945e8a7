"""The recurrent layers' side of a ShardedCache (generate.py): the convolution and scan states of a hybrid's
linear-attention, Mamba and short-convolution layers, through the Cache methods those layers call
(`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`, ...).

Unlike keys and values, a recurrent layer's state is small and the same whatever the length, so every rank
keeps all of it: each layer's is one of transformers' own `LinearAttentionLayer`s, and a decoded token
runs each recurrent layer whole on every rank, from the same state to the same state (state.hook lets it:
split_prompt says None), as on one device.

The prompt runs split across ranks: there the layers hand this rank's shard, and what the cache keeps is
the whole prompt's:
- the convolution state: the inputs of the prompt's last k tokens (zeros before its first), each taken
  from the rank that holds it, in one all-reduce of (batch, channels, k);
- the scan state: the split scans hand the state after the prompt's last real token, the same on every
  rank (mixers/ssm.py, linear_attention.py: the layout's padding left quiet); MiniMax's lightning attention
  keeps its state through get/set_linear_cache.
ZAYA's CCA and RecurrentGemma's blocks (which keep their states on themselves) take the prompt's last tokens
through prompt_tail (mixers/convolution.py, rg_lru.py), as DeepSeek-V4's compressors take the window not yet
ended (layers/compressed.py: its entries, too, are kept whole on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.cache_utils import LinearAttentionLayer


class RecurrentStates:
    """Mixed into ShardedCache, which provides `phase` ("prefill", "decode" or None), `prompt_length`,
    `group`, `world` and `_prefill_positions` ((batch, tokens) global positions of this rank's prompt shard)."""

    def forget_states(self) -> None:
        self._recurrent: dict[int, LinearAttentionLayer] = {}  # layer -> its states, the same on every rank
        self._linear: dict[int, torch.Tensor] = {}  # MiniMax's lightning attention: layer -> its K^T V state
        self.compressed_states: dict[int, object] = {}  # DeepSeek-V4: layer -> its compressor's cache layer

    def _recurrent_layer(self, layer_idx: int) -> LinearAttentionLayer:
        return self._recurrent.setdefault(layer_idx, LinearAttentionLayer())

    def split_prompt(self) -> int | None:
        """The prompt's real length while it runs split across ranks, None while a decoded token runs
        whole on every rank: what a recurrent layer's hook reads (mixers/state.py)."""
        if self.phase is None:
            raise ValueError("a recurrent layer ran with a ShardedCache outside generate()'s forward")
        return self.prompt_length if self.phase == "prefill" else None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self._recurrent_layer(layer_idx)
        return layer.conv_states[state_idx] if layer.has_previous_state[state_idx] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self._recurrent_layer(layer_idx)
        return layer.recurrent_states[state_idx] if layer.has_previous_state[state_idx] else None

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None:  # transformers asks of the last recurrent layer
            layer_idx = max(self._recurrent, default=None)
        layer = self._recurrent.get(layer_idx)
        return layer is not None and layer.has_previous_state[state_idx or 0]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # no rollback: assisted decoding is refused (ShardedCache.crop)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """conv_states: (batch, channels, tokens), the convolution's inputs. In the prefill, this rank's prompt
        shard: the prompt's last k are kept, and the shard is handed back for the split convolution."""
        layer = self._recurrent_layer(layer_idx)
        if self.phase != "prefill":
            return layer.update_conv_state(conv_states, state_idx, **kwargs)
        width = kwargs.get("conv_kernel_size")
        if width is None:
            raise ValueError(
                f"layer {layer_idx} updates its convolution state without conv_kernel_size: this transformers "
                "release arranges the layer differently from what burst's ShardedCache knows"
            )
        layer.update_conv_state(self.prompt_tail(conv_states, width), state_idx, **kwargs)
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._recurrent_layer(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """MiniMax's lightning attention: its state (batch, heads, d, d), set after the prompt by the split
        layer (mixers/linear_attention.py: the state after the prompt's last real token) and at each token."""
        return self._linear.get(layer_idx)

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self._linear[layer_idx] = state

    def prompt_tail(self, shard: torch.Tensor, width: int) -> torch.Tensor:
        """(batch, channels, width): the prompt's last `width` tokens of `shard` (batch, channels, tokens),
        each from the rank that holds it (zeros before the prompt's first token), the same on every rank."""
        positions = self._prefill_positions  # (batch, tokens): the same rows in every batch row
        if positions.shape[1] != shard.shape[-1]:
            raise ValueError(
                f"a recurrent layer's convolution state has {shard.shape[-1]} tokens, not this rank's "
                f"{positions.shape[1]} prompt tokens"
            )
        slot = positions[0] - (self.prompt_length - width)  # where each local token sits in the tail
        mine = (slot >= 0) & (slot < width)
        tail = shard.new_zeros(*shard.shape[:-1], width)
        tail[..., slot[mine]] = shard[..., mine]
        if self.world > 1:  # each token held by one rank: a sum of it and zeros
            dist.all_reduce(tail, group=self.group)
        return tail
