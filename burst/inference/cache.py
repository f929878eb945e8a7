"""A KV cache that stays sharded: each rank keeps the K, V of its own tokens, for every layer.

Prefill stores the prompt tokens this rank holds under the layout (their global positions are kept,
so a padded batch of prompts of different lengths knows which entries are real). Decode appends
each new token's K, V to one rank, in turn (step s goes to rank s mod G), so shards stay balanced as
the cache grows; every rank attends its shard and decode_attention merges the partial results.
"""

from __future__ import annotations

import torch

from ..agreement import agree
from ..comm.membership import group_rank, group_size
from ..layout import shard_indices


def attended(valid: torch.Tensor, positions: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The entries still valid once only `chosen` positions are attended: valid, positions (batch, entries);
    chosen: bool (batch, positions) -> (batch, entries), or (batch, kv_heads, positions), a choice per KV
    head -> (batch, entries, kv_heads). An entry past chosen's last position (the storage's padding) is not."""
    chosen = chosen.to(positions.device)
    valid = valid & (positions < chosen.shape[-1])
    at = positions.clamp(max=chosen.shape[-1] - 1)
    if chosen.dim() == 2:
        return valid & chosen.gather(1, at)
    picked = chosen.gather(2, at[:, None].expand(-1, chosen.shape[1], -1)).transpose(1, 2)
    return valid[:, :, None] & picked


class ShardedKVCache:
    """This rank's shard of every layer's keys and values.

    k[layer], v[layer]: (batch, entries, kv_heads, head_dim); positions: (batch, entries) global
    positions of the entries (the same for every layer); valid: (batch, entries) bool, False for
    padding of a shorter prompt. Storage grows in chunks, so appending a token is amortized O(1).
    """

    def __init__(self, layers: int, group=None, layout: str = "contiguous", chunk: int = 256):
        for name, value in (("layers", layers), ("chunk (entries the storage grows by)", chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ShardedKVCache {name} must be a positive int, got {value!r}")
        self.layers, self.group, self.layout, self.chunk = layers, group, layout, chunk
        self.world = group_size(group)
        self.rank = group_rank(group)
        self._k: list[torch.Tensor | None] = [None] * layers
        self._v: list[torch.Tensor | None] = [None] * layers
        self._positions: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self.length = 0  # entries held by this rank
        self._pending: set[int] = set()  # layers that appended this decode step's token here
        self._appended: set[int] = set()  # layers that called append this step, on every rank (owner or not)
        self.decoded = 0  # tokens appended by decode steps (on all ranks together)

    # -- prefill -------------------------------------------------------------------------------
    def prefill_positions(self, prompt_lengths: list[int], padded_len: int, device=None) -> torch.Tensor:
        """Global positions of this rank's prompt shard, (batch, padded_len / G), and remembers which
        are real tokens (position < the row's prompt length)."""
        problem = None
        if not all(isinstance(n, int) and 0 <= n <= padded_len for n in prompt_lengths):
            problem = ValueError(
                f"prompt lengths {prompt_lengths} do not fit the padded length {padded_len} (ints from 0 to it)"
            )
        facts = {"prompt lengths": tuple(prompt_lengths), "padded length": padded_len}
        agree("ShardedKVCache.prefill_positions", None if problem else facts, problem, self.group, self.world)
        idx = shard_indices(self.layout, self.rank, self.world, padded_len, device=device)
        positions = idx.expand(len(prompt_lengths), -1)
        lengths = torch.tensor(prompt_lengths, device=device)[:, None]
        self._positions, self._valid = positions.clone(), positions < lengths
        return positions

    def store_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (batch, padded_len / G, kv_heads, head_dim) of this rank's prompt shard (after prefill_positions)."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"ShardedKVCache: layer {layer} is not one of the {self.layers} layers")
        if self._positions is None or k.shape[:2] != self._positions.shape or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"ShardedKVCache.store_prefill: k {tuple(k.shape)}, v {tuple(v.shape)} must be (batch, tokens, "
                f"kv_heads, d) of this rank's prompt shard: (batch, tokens) = "
                f"{None if self._positions is None else tuple(self._positions.shape)} (prefill_positions first)"
            )
        self._k[layer], self._v[layer] = self._grow(k), self._grow(v)
        self.length = k.shape[1]

    # -- decode --------------------------------------------------------------------------------
    def owner_of_next(self) -> int:
        """The rank that stores the next decoded token (in turn, so shards stay balanced)."""
        return self.decoded % self.world

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor) -> None:
        """Store one decoded token's K, V (batch, 1, kv_heads, head_dim) when this rank owns it.

        Call for every layer of the step, then `advance()` once; keys_values(layer) includes the new
        token from its append on (a token attends itself). positions: (batch,) global positions.
        """
        self._check_new_token(layer, k_new, v_new, positions)  # on every rank, owner or not: they raise alike
        self._appended.add(layer)
        if self.owner_of_next() != self.rank:
            return
        at = self.length
        for store, new in ((self._k, k_new), (self._v, v_new)):
            if at >= store[layer].shape[1]:
                store[layer] = self._grow(store[layer], extra=self.chunk)
            store[layer][:, at : at + 1] = new
        if not self._pending:
            if at >= self._positions.shape[1]:
                pad = self._positions.new_zeros(self._positions.shape[0], self.chunk)
                self._positions = torch.cat([self._positions, pad], 1)
                self._valid = torch.cat([self._valid, torch.zeros_like(pad, dtype=torch.bool)], 1)
            self._positions[:, at] = positions
            self._valid[:, at] = True
        self._pending.add(layer)

    def advance(self) -> None:
        """Close a decode step (after every layer appended)."""
        missing = [i for i, k in enumerate(self._k) if k is not None and i not in self._appended]
        self._appended.clear()
        if missing:  # their entry at this token would be the storage's zeros, attended by the next steps
            raise ValueError(
                f"ShardedKVCache.advance: layers {missing} stored a prompt and appended no token this step"
            )
        if self.owner_of_next() == self.rank:
            self.length += 1
        self._pending.clear()
        self.decoded += 1

    # -- reading -------------------------------------------------------------------------------
    def keys_values(
        self, layer: int, since: torch.Tensor | None = None, chosen: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, valid) of the entries this rank holds for `layer` (k, v views, no copy).

        since: (batch,) the oldest global position each row may attend (a sliding window), or None:
        older entries stay stored but are marked invalid. chosen: bool (batch, positions), or (batch,
        kv_heads, positions) for a choice per KV head, True at the global positions a row attends (an
        indexer's top-k: DeepSeek sparse attention, MiniMax-M3's blocks), or None. valid: (batch, entries),
        or (batch, entries, kv_heads) with a choice per KV head.
        """
        self._check_prefilled(layer)
        n = self.length + (1 if layer in self._pending else 0)
        valid = self._valid[:, :n]
        positions = self._positions[:, :n]
        if since is not None:
            valid = valid & (positions >= since.to(positions.device)[:, None])
        if chosen is not None:
            valid = attended(valid, positions, chosen)
        return self._k[layer][:, :n], self._v[layer][:, :n], valid

    def entry_positions(self, entries: int) -> torch.Tensor:
        """(batch, entries) global positions of this rank's first `entries` entries (keys_values' order)."""
        return self._positions[:, :entries]

    def bytes(self) -> int:
        """Bytes of K, V this rank holds (entries in use; values may be narrower than keys)."""
        stored = [t for t in (*self._k, *self._v) if t is not None]
        return sum(t[:, : self.length].numel() * t.element_size() for t in stored)

    def _check_prefilled(self, layer: int) -> None:
        if not 0 <= layer < self.layers or self._k[layer] is None:
            raise ValueError(
                f"ShardedKVCache: layer {layer} has no prompt stored (store_prefill each of the {self.layers} "
                "layers first)"
            )

    def _check_new_token(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor) -> None:
        """The token's K, V as the layer stores them, once per step, at integer positions (batch,)."""
        self._check_prefilled(layer)
        if layer in self._appended:
            raise ValueError(f"ShardedKVCache.append: layer {layer} appended twice in one step (advance() between)")
        for name, new, stored in (("k", k_new, self._k[layer]), ("v", v_new, self._v[layer])):
            want = (stored.shape[0], 1, *stored.shape[2:])
            if tuple(new.shape) != want or new.dtype != stored.dtype:
                raise ValueError(
                    f"ShardedKVCache.append: {name} {tuple(new.shape)} {new.dtype}, layer {layer} stores "
                    f"{want} {stored.dtype}"
                )
        integer = (
            isinstance(positions, torch.Tensor) and not positions.is_floating_point() and positions.dtype != torch.bool
        )
        if not integer or positions.shape != want[:1]:  # a bool tensor would be positions 0 and 1
            raise ValueError(f"ShardedKVCache.append: positions must be an integer tensor of shape {want[:1]}")

    def _grow(self, t: torch.Tensor, extra: int | None = None) -> torch.Tensor:
        extra = self.chunk if extra is None else extra
        grown = t.new_zeros(t.shape[0], t.shape[1] + extra, *t.shape[2:])
        grown[:, : t.shape[1]] = t
        return grown
