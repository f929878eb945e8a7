"""DeepSeek-V4's compressed attention (CSA and HCA), its entries made across ranks.

Each V4 attention layer beside its sliding window attends compressed entries: one per window of
`compress_rate` tokens (CSA: 4, HCA: 128), a softmax-gated sum of the window's projections (CSA
windows overlap: entry w also reads the first half of window w - 1's projections), normed and
rotated at the window's first position. A CSA layer's own lightning indexer, with entries of its
own made the same way, then picks each query's top-k entries; an HCA query sees every entry whose
window has ended. On a shard the compressors would see only its own windows, from position 0.

`compress_whole_sequence(model, group, layout)` (its entry of backend/features.py, run by every door that prepares
a model) takes over the forward of each compressor:

- entries are made where their windows' tokens live: each chunk of a rank's shard (layout runs)
  makes the entries whose window ends inside it, with a halo of the tokens before it (state_passing.
  halo: CSA's window before the chunk, plus the start of a window that crosses a chunk boundary; none
  for HCA when the chunks hold whole windows), so every window is made whole; rotated at its global
  position;
- one differentiable all-gather then gives every rank every entry in global order (N / rate of
  them: N/4 and N/128 entries of head_dim, against the N tokens of K/V the ring moves), counted in
  CommStats under "compressed" (the halo too; the indexer's entries under "indexer");
- the CSA indexer runs its own code (scores, causal threshold, top-k) on this rank's queries
  against the whole sequence's indexer entries, made the same way and handed to it through a
  stand-in for its cache;
- the layer then concatenates the entries to its keys, as in one process, and the attention function
  hands them to burst.attention as a burst.CompressedKV (with the indexer's choice for CSA): folded
  into each row beside the ring's sliding window and the sinks (burst/compressed.py), never
  travelling with the ring.

Ties in the indexer's top-k break as on one device wherever a row's scores are equal bit for bit;
see indexer.py for the exact zeros a ReLU can leave.

Decoding runs on burst's ShardedCache (generate.py): the prompt's run fills, for each layer, a cache layer of
the family's own class as one process's would be after the prompt (entries, the tokens of the window not yet
ended, CSA's last ended window), whole on every rank (a few entries and at most 2 x rate - 1 tokens, gathered
once); each decoded token then runs the compressor's and indexer's own forward on it, the same on every rank,
and each rank attends its share of the entries beside its shard of the sliding window's keys. On any other
cache the first forward runs and decoding is refused.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch

from burst import layout as layout_mod
from burst import state_passing

from ..keywords import cache_keyword
from .configs import PreparedConfigs, text_config
from .indexer import one_sequence_per_row, refuse_decoding

_prepared = PreparedConfigs()  # the configs of models whose compressors see the whole sequence
PENDING = "_burst_compressed"  # the attention module's entries' rate and choice, for its attention function


def kind(module: torch.nn.Module) -> str | None:
    """ "csa" or "hca" for a DeepSeek-V4 compressor, else None."""
    name = type(module).__name__
    if not all(hasattr(module, a) for a in ("compress_rate", "kv_proj", "gate_proj", "position_bias", "kv_norm")):
        return None
    if name.endswith("CSACompressor") and hasattr(module, "indexer"):
        return "csa"
    if name.endswith("HCACompressor"):
        return "hca"
    return None


def prepared(config) -> bool:
    return config in _prepared


def compress_whole_sequence(model: torch.nn.Module, group=None, layout="contiguous") -> int:
    """Take over the forward of every DeepSeek-V4 compressor of `model` (see the module docstring);
    returns how many. ValueError for a layout without runs of positions (striped, doc_*)."""
    layers = [(m, a) for m in model.modules() for a in m.children() if kind(a) is not None]
    if not layers:
        return 0
    if layout not in layout_mod.LAYOUTS:
        raise ValueError(
            f"{type(model).__name__}: compressed attention runs under the layouts {layout_mod.LAYOUTS}, not {layout!r}"
        )
    world, _ = layout_mod._world_and_rank(group)
    state_passing.chunks(layout, group, 2 * world)  # striped raises here: its shards have no runs
    for attention, compressor in layers:
        compressor.forward = functools.partial(
            _whole_sequence_compressor, compressor, weakref.ref(attention), group, layout
        )
    _prepared.add(model.config, text_config(model.config))
    return len(layers)


def _whole_sequence_compressor(
    module,
    attention,
    group,
    layout,
    hidden_states,
    q_residual,
    position_ids,
    cache=None,
    layer_idx=None,
    past_key_values=None,
):
    """(entries (batch, 1, n, head_dim) of the whole sequence, None): the layer concatenates them to its
    keys; their rate and the CSA indexer's choice wait on the attention module for its attention
    function (PENDING). On burst's ShardedCache the prompt's run also keeps what decoding needs, and a
    decode step runs the compressor's own forward on it (_decode_step)."""
    cache = cache if cache is not None else past_key_values
    kept = getattr(cache, "compressed_states", None)  # a ShardedCache (generate.py)
    if kept is None:
        refuse_decoding(
            f"{type(module).__name__}: decoding on a cache with DeepSeek-V4's compressed attention under burst",
            cache,
            layer_idx,
        )
    elif cache.phase == "decode":
        return _decode_step(module, attention(), kept[layer_idx], hidden_states, q_residual, position_ids, layer_idx)
    _check_runs_on_burst(module, attention())
    one_sequence_per_row(
        f"{type(module).__name__}: DeepSeek-V4's compressed attention", position_ids, group, layout, hidden_states
    )  # entries over a packed row would span its documents
    overlap = kind(module) == "csa"
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)
    entries = whole_sequence_entries(module, kv, gate, group, layout, overlap)
    layer = None
    if kept is not None:  # the prompt of a generation: the state of one process's cache after it
        entries = _of_the_prompt(entries, cache, module)
        layer = kept[layer_idx] = _cache_layer(module, attention())
        _keep_prompt_state(cache, layer, "compressor", module, kv, gate, entries, overlap)
    chosen = None
    if overlap:
        indexer = module.indexer
        stand_in = _IndexerEntries(indexer, group, layout, layer_idx, cache, layer)
        chosen = indexer(
            hidden_states,
            q_residual,
            position_ids,
            **{cache_keyword(type(indexer).forward): stand_in},
            layer_idx=layer_idx,
        )
    setattr(attention(), PENDING, (module.compress_rate, entries.shape[1], chosen))
    return entries.unsqueeze(1), None


def _check_runs_on_burst(module, attention) -> None:
    """ValueError unless the layer's attention function is burst's: any other would be handed the
    entries without their per-query validity (transformers' block bias, which burst does not build)
    and let every query see every entry."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(getattr(attention, "config", None), "_attn_implementation", None)
    if getattr(ALL_ATTENTION_FUNCTIONS.get(name), "__name__", None) != "burst_attention_forward":
        raise ValueError(
            f"{type(module).__name__}: this model was prepared for burst's attention backend "
            f"(bt.shard_batch(..., model=model)), whose compressed attention runs only there; "
            f"attn_implementation={name!r} is not a burst backend"
        )


class _IndexerEntries:
    """Stands in for a CSA cache layer inside the indexer's forward: the indexer hands it this rank's
    projections, it makes the whole sequence's indexer entries from them and returns them as the
    cache's entries, so the indexer's own code scores and picks over every entry."""

    def __init__(self, indexer, group, layout, layer_idx, cache=None, kept=None):
        self.indexer, self.group, self.layout = indexer, group, layout
        self.layers = {layer_idx: self}
        self.entries = None
        self.cache, self.kept = cache, kept  # a ShardedCache's prompt: its cache layer, kept for decoding

    def store_compression_weights(self, name, kv, gate):
        self.entries = whole_sequence_entries(
            self.indexer, kv, gate, self.group, self.layout, overlap=True, phase="indexer"
        )
        if self.kept is not None:
            self.entries = _of_the_prompt(self.entries, self.cache, self.indexer)
            _keep_prompt_state(self.cache, self.kept, "indexer", self.indexer, kv, gate, self.entries, overlap=True)
        return kv[:, :0], gate[:, :0], 0  # nothing left for the indexer to compress itself

    def update_compressor_states(self, name, compressed):
        return self.entries


# ---- decoding on burst's ShardedCache ---------------------------------------------------------------------


def _cache_layer(compressor, attention):
    """A fresh cache layer of the family's own (DeepseekV4CSACache or HCACache) for this layer's compressor:
    it holds, whole on every rank, the entries, the tokens of the window not yet ended and (CSA) the last
    ended window's first half, for the compressor and the CSA indexer alike."""
    family = sys.modules[type(compressor).__module__]
    name = "DeepseekV4CSACache" if kind(compressor) == "csa" else "DeepseekV4HCACache"
    cls = getattr(family, name, None)
    if cls is None:
        raise ValueError(
            f"{type(compressor).__name__}: decoding on a ShardedCache needs transformers' {name}, which this "
            "release does not have"
        )
    return cls(attention.config)


def _of_the_prompt(entries, cache, module):
    """The entries whose windows end inside the prompt, without the layout's padding: as many as one process
    makes, so that the indexer's top-k breaks its exact ties (scores a ReLU leaves at zero) as there."""
    return entries[:, : cache.prompt_length // module.compress_rate]


def _keep_prompt_state(cache, layer, name: str, module, kv, gate, entries, overlap: bool) -> None:
    """Fill `layer`'s state `name` ("compressor" or "indexer") as one process's cache holds it after the
    prompt, through the layer's own methods: the entries of the windows that end inside the prompt, the
    projections of the tokens after them (its buffer), and for overlapping windows the last ended window's
    (the next entry reads its first half).

    kv, gate: (batch, local, C) this rank's projections of its prompt shard (padding past the prompt);
    entries: (batch, n, head_dim) those of the windows that end inside the prompt, on every rank."""
    rate, length = module.compress_rate, cache.prompt_length
    ended = length // rate
    layer.update_compressor_states(name, entries)
    start = (ended - 1) * rate if overlap and ended else ended * rate
    channels = kv.shape[-1]
    tail = torch.cat([kv, gate.to(kv.dtype)], dim=-1)  # (batch, local, 2C)
    if length > start:  # the same on every rank: each takes part in the tail's all-reduce or none does
        tail = cache.prompt_tail(tail.transpose(1, 2), length - start).transpose(1, 2)  # (batch, length - start, 2C)
    else:
        tail = tail[:, :0]
    if overlap and ended:
        window = tail[:, None, :rate]
        gates = window[..., channels:].to(gate.dtype) + module.position_bias  # as the compressor adds it
        layer.update_overlap_state(name, window[..., :channels], gates, module.head_dim)
        tail = tail[:, rate:]
    layer.store_compression_weights(name, tail[..., :channels], tail[..., channels:].to(gate.dtype))


def _decode_step(module, attention, layer, hidden_states, q_residual, position_ids, layer_idx):
    """A decoded token through the compressor's own forward (and its indexer's), on the cache layer the
    prompt filled: every rank makes the same entries and the same choice, and hands them, as in the
    prompt, to the attention function (PENDING), which gives each rank its share of the entries."""
    cache = _OneLayer(layer_idx, layer)
    entries, bias = type(module).forward(module, hidden_states, q_residual, position_ids, cache, layer_idx)
    chosen = None if bias is None else bias[:, 0, 0] == 0  # (batch, entries): the indexer's top-k, ended
    setattr(attention, PENDING, (module.compress_rate, entries.shape[2], chosen))
    return entries, bias


def with_share_of_entries(entries: tuple, k, v, valid, group) -> tuple:
    """(k, v, valid) this rank attends in a decode step: its cached keys and its share of the entries.

    entries: (k, v, chosen) of the compressed entries, (batch, n, kv_heads, d) and (batch, n) bool, the same
    on every rank; k, v, valid: this rank's cached entries (ShardedKVCache.keys_values). Rank r attends
    entries [n r / G, n (r + 1) / G): each entry once in the merge, and the work split evenly."""
    world, rank = layout_mod._world_and_rank(group)
    ek, ev, chosen = entries
    n = ek.shape[1]
    share = slice(n * rank // world, n * (rank + 1) // world)
    ek, ev, chosen = ek[:, share].to(k.dtype), ev[:, share].to(v.dtype), chosen[:, share]
    if valid.dim() == 3:  # a choice per KV head on the cached keys: the entries' holds for every head
        chosen = chosen[..., None].expand(-1, -1, valid.shape[2])
    return torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1), torch.cat([valid, chosen], dim=1)


class _OneLayer:
    """Stands in for a cache in a decode step's compressor and indexer: `layers[layer_idx]` is the layer."""

    def __init__(self, layer_idx: int, layer):
        self.layers = {layer_idx: layer}


def whole_sequence_entries(
    module, kv: torch.Tensor, gate: torch.Tensor, group, layout, overlap: bool, phase: str = "compressed"
) -> torch.Tensor:
    """Every entry of the sequence, (batch, N // rate, head_dim), in global order, on every rank.
    Its halo and gather are counted in CommStats under `phase` (the indexer's entries: "indexer").

    kv, gate: (batch, local, C) this rank's projections (C = head_dim, or 2 head_dim for overlapping
    windows: the first half is read by the next window). module: the compressor (its rate, head_dim,
    position_bias, kv_norm and rotary embedding)."""
    rate = module.compress_rate
    local = kv.shape[1]
    mine, every = state_passing.chunks(layout, group, local)
    if local * len(every) < rate:  # no window has ended: no entry, as in one process (every rank knows it)
        return kv.new_zeros(kv.shape[0], 0, module.head_dim)
    # the tokens a chunk needs before it: its first window's part there, and the window before (overlap)
    width = max(s.first % rate for segs in every for s in segs) + (rate if overlap else 0)
    both = torch.cat([kv, gate.to(kv.dtype)], dim=-1)
    if len(every) == 1:  # one rank holds the whole sequence in order, whatever the layout
        before = both.new_zeros(both.shape[0], width, both.shape[2])
        return _entries_of_chunk(module, torch.cat([before, both], dim=1), 0, local, width, overlap)
    if width == 0:  # windows aligned with every chunk and not overlapping (HCA): nothing from before
        halos = [both[:, :0]] * len(mine)
    else:
        tails = [both[:, seg.rows][:, -width:] for seg in mine]
        halos = state_passing.halo(tails, width, layout, group, local, phase=phase, dim=1)  # wider than chunks too
    made = [
        _entries_of_chunk(module, torch.cat([halo, both[:, seg.rows]], dim=1), seg.first, seg.length, width, overlap)
        for seg, halo in zip(mine, halos)
    ]
    return _gathered_in_order(made, every, rate, group, phase)


def _entries_of_chunk(module, tokens, first: int, length: int, width: int, overlap: bool) -> torch.Tensor:
    """The entries whose window ends in the chunk [first, first + length): (batch, n, head_dim).

    tokens: (batch, width + length, 2C), kv then gate, of positions first - width onward (zeros
    before position 0)."""
    rate, head_dim = module.compress_rate, module.head_dim
    lo, hi = _windows_ending_in(first, length, rate)
    batch, channels = tokens.shape[0], tokens.shape[2] // 2
    back = 1 if overlap else 0
    start = (lo - back) * rate - (first - width)
    windows = tokens[:, start : start + (hi - lo + back) * rate].reshape(batch, hi - lo + back, rate, 2 * channels)
    kv, gate = windows[..., :channels], windows[..., channels:] + module.position_bias
    if overlap:  # entry w: window w - 1's first half beside window w's second half (a window before 0 weighs 0)
        kv = torch.cat([kv[:, :-1, :, :head_dim], kv[:, 1:, :, head_dim:]], dim=2)
        earlier = gate[:, :-1, :, :head_dim]
        if lo == 0:
            earlier = torch.cat([torch.full_like(earlier[:, :1], float("-inf")), earlier[:, 1:]], dim=1)
        gate = torch.cat([earlier, gate[:, 1:, :, head_dim:]], dim=2)
    compressed = module.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
    positions = (torch.arange(lo, hi, device=tokens.device) * rate).unsqueeze(0).expand(batch, -1)
    cos, sin = module.rotary_emb(compressed, position_ids=positions, layer_type=module.rope_layer_type)
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    return rotate(compressed.unsqueeze(1), cos, sin).squeeze(1)


def _windows_ending_in(first: int, length: int, rate: int) -> tuple[int, int]:
    """The windows [lo, hi) whose last token lies in the chunk [first, first + length)."""
    return first // rate, (first + length) // rate


def _gathered_in_order(made, every, rate: int, group, phase: str = "compressed") -> torch.Tensor:
    """Every rank's chunks' entries (one all-gather, each chunk padded to the most any chunk makes),
    concatenated in global order."""
    counts = [[hi - lo for lo, hi in (_windows_ending_in(s.first, s.length, rate) for s in segs)] for segs in every]
    most = max(max(c) for c in counts)
    padded = [torch.nn.functional.pad(e, (0, 0, 0, most - e.shape[1])) for e in made]
    gathered, anchor = state_passing.all_gather_tensors(padded, group, phase)  # counted in CommStats
    order = sorted((seg.first, r, c) for r, segs in enumerate(every) for c, seg in enumerate(segs))
    return torch.cat([gathered[r][c][:, : counts[r][c]] for _, r, c in order], dim=1) + anchor


def pending(module):
    """(rate, entries, the CSA indexer's choice or None) that the layer's compressor left for this
    attention call, taken (None when it left nothing)."""
    found = getattr(module, PENDING, None)
    if found is not None:
        setattr(module, PENDING, None)
    return found
