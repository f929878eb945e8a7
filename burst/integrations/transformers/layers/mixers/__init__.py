"""transformers' recurrent and convolutional sequence mixers, exact across ranks (state passing).

Hybrid models (Qwen3-Next / Qwen3.5's gated delta net, Mamba and Mamba2 layers, LFM's short
convolutions) mix tokens outside attention, through a few module-level functions of each family's
modeling file: `causal_conv1d_fn`, `torch_chunk_gated_delta_rule`, `chunk_kimi_delta_attention`,
`mamba2_chunk_scan`, `mamba_selective_scan`. `shard_mixers(model)` wraps those functions in the
model's modeling module (the wrapper calls the original unchanged unless a sharded mixer is
running) and hooks the model's mixer modules (found by which of those functions their forward
calls), so that inside them each function runs on this rank's chunks with the state and the
convolution halo they would have had in one process (burst/state_passing.py: one all-gather of
O(state) bytes per layer).

Each scan's state after a chunk is affine in the state before it, and so is every output before
the family's nonlinear gates. The wrapper gets both linear maps from the original function in the
same call: it appends identity "columns" to the state (and zero inputs for them), so the final
state's extra columns are the chunk's transition and the outputs' extra columns are how each
output reads the starting state. The output is then out(0) + coefficients @ start. (Mamba's
selective scan takes no starting state, so its transition and coefficients are computed from its
decays directly. RWKV-4's WKV and xLSTM's mLSTM divide by their state, and MiniMax's lightning
attention has its loop inline in the layer's forward: those run each chunk twice, from zero for its
final state, then from the state it truly starts from. RecurrentGemma's RG-LRU keeps its state on
the module: each chunk runs from 0 and from 1 (the difference is its transition), then from its true
start; its temporal convolution is an nn.Conv1d module, whose forward takes the halo.)

Supported families are listed in FAMILIES (each one tested exact at 2-4 ranks against one
process); any other family whose config has non-attention layers stays refused at more than one
rank (backend/checks.py: check_config). Inside a sharded mixer, the paths this cannot split raise:
cached decoding (`causal_conv1d_update`, the recurrent and single-step updates) and the fused CUDA
kernels that do the convolution and scan in one call. generate() on a ShardedCache runs its prompt split
(each scan hands the state after the prompt's last real token, the same on every rank) and each decoded
token whole on every rank (the families of GENERATE; ../../recurrent_states.py keeps their states).

One module per kind, each built on state.py (Shards, the running mixer, the wrapping, the
run-twice scheme) and none on another:

    ssm.py               Mamba's selective scan, Mamba2's chunked scan
    linear_attention.py  the gated delta rule (and Kimi's), MiniMax's lightning attention
    convolution.py       short causal convolutions (halos), RecurrentGemma's Conv1d, RWKV's token shift
    rg_lru.py            RecurrentGemma's RG-LRU
    normalised.py        RWKV-4's WKV and xLSTM's mLSTM (their output divides by their state)
    families.py          FAMILIES and shard_mixers, which wires the kinds into a model
"""

from __future__ import annotations

from .convolution import TokenShift
from .families import FAMILIES, FUSED, GENERATE, UNSPLIT, generates, prepared, shard_mixers, supported
from .state import Shards

__all__ = [
    "FAMILIES",
    "FUSED",
    "GENERATE",
    "Shards",
    "TokenShift",
    "UNSPLIT",
    "generates",
    "prepared",
    "shard_mixers",
    "supported",
]
