"""transformers' recurrent and convolutional sequence mixers, exact across ranks (state passing).

Hybrid models (Qwen3-Next / Qwen3.5's gated delta net, Mamba and Mamba2 layers, LFM's short
convolutions) mix tokens outside attention, through a few module-level functions of each family's
modeling file: `causal_conv1d_fn`, `torch_chunk_gated_delta_rule`, `chunk_kimi_delta_attention`,
`mamba2_chunk_scan`, `mamba_selective_scan`. `shard_mixers(model)` wraps those functions in the model's modeling module
(the wrapper calls the original unchanged unless a sharded mixer is running) and hooks the model's
mixer modules (found by which of those functions their forward calls), so that inside them each
function runs on this rank's chunks with the state and the convolution halo they would have had in
one process (burst/state_passing.py: one all-gather of O(state) bytes per layer).

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
rank (backend/checks.py: check_config). Inside a sharded mixer, the paths this cannot split raise: cached
decoding (`causal_conv1d_update`, the recurrent and single-step updates) and the fused CUDA kernels
that do the convolution and scan in one call.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from burst import state_passing
from burst.layout import _world_and_rank

from ...keywords import ATTENTION_LAYER_KINDS, layer_kinds
from .. import rope

# model_type -> the mixers its layers use (documentation and the README's list; the functions
# themselves are found by name in the family's modeling module).
FAMILIES: dict[str, tuple[str, ...]] = {
    "lfm2": ("short convolution",),
    "lfm2_moe": ("short convolution",),
    "lfm3": ("short convolution",),
    "qwen3_next": ("short convolution", "gated delta rule"),
    "qwen3_5": ("short convolution", "gated delta rule"),
    "qwen3_5_text": ("short convolution", "gated delta rule"),
    "qwen3_5_moe": ("short convolution", "gated delta rule"),
    "qwen3_5_moe_text": ("short convolution", "gated delta rule"),
    "olmo_hybrid": ("short convolution", "gated delta rule"),
    "lara_mini": ("short convolution", "gated delta rule"),
    "mamba": ("short convolution", "Mamba selective scan"),
    "falcon_mamba": ("short convolution", "Mamba selective scan"),
    "jamba": ("short convolution", "Mamba selective scan"),
    "mamba2": ("short convolution", "Mamba2 chunked scan"),
    "bamba": ("short convolution", "Mamba2 chunked scan"),
    "falcon_h1": ("short convolution", "Mamba2 chunked scan"),
    "granitemoehybrid": ("short convolution", "Mamba2 chunked scan"),
    "nemotron_h": ("short convolution", "Mamba2 chunked scan"),
    "zamba2": ("short convolution", "Mamba2 chunked scan"),
    "kimi_linear": ("short convolution", "Kimi delta attention"),
    "bailing_hybrid": ("short convolution", "Kimi delta attention"),
    "rwkv": ("token shift", "RWKV-4 WKV"),
    "minimax": ("lightning attention",),
    "xlstm": ("mLSTM",),
    "recurrent_gemma": ("temporal convolution", "RG-LRU"),
}

# Cached decoding, which cannot run on a shard (the pre-hook refuses a cache first; these are the backstop).
UNSPLIT = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "mamba_selective_state_update",
           "mamba2_selective_state_update", "recurrent_kimi_delta_attention")
# Fused CUDA kernels (convolution + scan + projections in one call); their torch stand-ins return None, which
# the mixers read as "no kernel: take the unfused path". Sharded, they return None, so the unfused path, whose
# convolution and scan burst splits, runs (on a GPU too, through its own kernels).
FUSED = ("mamba_inner_fn", "mamba2_split_conv1d_scan_combined")


@dataclass(frozen=True)
class Shards:
    """Where the running mixer's shard sits: the group and layout of the model's sequence split."""

    group: object
    layout: object
    world: int


_running: contextvars.ContextVar[Shards | None] = contextvars.ContextVar("burst_sharded_mixer", default=None)
_prepared: dict[int, weakref.ref] = {}  # id(config) -> config, for configs of models shard_mixers prepared


def supported(model_type: str | None) -> bool:
    return model_type in FAMILIES


def prepared(config) -> bool:
    """Whether shard_mixers prepared a model with this config (or its text config)."""
    ref = _prepared.get(id(config))
    return ref is not None and ref() is config


def shard_mixers(model: torch.nn.Module, group=None, layout="contiguous") -> int:
    """Make `model`'s recurrent and convolutional mixers pass their state across the ranks of
    `group` for a sequence sharded by `layout` ("contiguous" or "zigzag", as given to shard_batch).
    Returns how many mixer modules were hooked (0 for a model without any). ValueError for a family
    that has such mixers and is not in FAMILIES. Calling it again with other settings replaces them."""
    done = getattr(model, "_burst_mixers", None)
    if done is not None and done[0] is group and done[1] == layout:  # shard_batch(model=) calls it every step
        return done[2]
    _capture_position_ids(model)
    rope.see_global_length(model, group)
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    module = sys.modules[type(model).__module__]
    names = [n for n in (*_SHARDED, *UNSPLIT, *FUSED) if callable(getattr(module, n, None))]
    inline = [m for m in model.modules() if type(m).__name__ in _TAKEN_OVER]
    model_type, world = getattr(text, "model_type", None), _world_and_rank(group)[0]
    family = supported(model_type) or supported(getattr(config, "model_type", None))
    if not names and not inline:
        if family and world > 1:  # a supported family whose mixers are not where burst looks would run unhooked
            raise ValueError(f"{type(model).__name__}: neither its modeling module's functions ({sorted(_SHARDED)}) "
                             f"nor its modules ({sorted(_TAKEN_OVER)}) are what burst splits; this transformers "
                             "release arranges the family differently from what burst knows")
        return 0
    if not family:
        if world == 1:  # the whole sequence on one rank: nothing to pass (check_model decides)
            return 0
        raise ValueError(f"model_type {model_type!r} mixes tokens outside attention ({', '.join(names)}) and is "
                         f"not among the families burst makes exact across ranks: {sorted(FAMILIES)}")
    state_passing.chunks(layout, group, 2 * world)  # a layout without runs (striped) raises here
    for name in names:
        _wrap(module, name)
    shards = Shards(group, layout, world)
    mixers = [m for m in model.modules() if _calls_any(type(m), tuple(names))]
    for mixer in inline:
        _take_over(mixer, shards)
    _shard_convolution_modules(model, shards)
    if not mixers and not inline and _mixes_outside_attention(text):
        raise ValueError(f"{type(model).__name__}: found none of the modules that call {names}; this "
                         "transformers release arranges the family differently from what burst knows")
    for mixer in mixers:
        for handle in getattr(mixer, "_burst_mixer_hooks", ()):
            handle.remove()
        mixer._burst_mixer_hooks = _hook(mixer, shards)
    _shard_token_shifts(model, shards)
    for c in {id(config): config, id(text): text}.values():
        _prepared[id(c)] = weakref.ref(c)
    model._burst_mixers = (group, layout, len(mixers) + len(inline))
    return len(mixers) + len(inline)


def _cache_refused(module, world: int) -> ValueError:
    return ValueError(f"{type(module).__name__}: a cache (generation) with the sequence split across {world} ranks "
                      "is not supported for recurrent layers; a training step or a plain forward needs none: "
                      "model(**batch, use_cache=False)")


def _mixes_outside_attention(config) -> bool:
    return bool(layer_kinds(config) - ATTENTION_LAYER_KINDS)


def _hook(mixer: torch.nn.Module, shards: Shards):
    tokens: list = []

    def enter(module, args, kwargs):
        if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
            if shards.world > 1:
                raise _cache_refused(module, shards.world)
        tokens.append(_running.set(shards))

    def leave(module, args, kwargs, output):
        if tokens:
            _running.reset(tokens.pop())

    return (mixer.register_forward_pre_hook(enter, with_kwargs=True),
            mixer.register_forward_hook(leave, with_kwargs=True, always_call=True))


@functools.lru_cache(maxsize=None)
def _calls_any(cls, names: tuple[str, ...]) -> bool:
    forward = getattr(cls, "forward", None)
    if forward is None or getattr(cls, "__module__", "").startswith("torch."):
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return any(f"{n}(" in source for n in names)


def _wrap(module, name: str) -> None:
    original = getattr(module, name)
    if getattr(original, "_burst_original", None) is not None:
        return
    sharded = _SHARDED.get(name)

    def dispatch(*args, **kwargs):
        shards = _running.get()
        if shards is None or shards.world == 1:
            return original(*args, **kwargs)
        if name in FUSED:
            return None
        if sharded is None:
            raise ValueError(f"{name} (cached decoding) runs on one shard at a time and cannot pass state across "
                             f"{shards.world} ranks")
        return sharded(original, shards, *args, **kwargs)

    dispatch._burst_original = original
    dispatch.__name__ = getattr(original, "__name__", name)
    dispatch.__doc__ = getattr(original, "__doc__", None)
    setattr(module, name, dispatch)


# ---- the sharded functions: (original, shards, *the original's arguments) -> the original's result ----

def _local_chunks(shards: Shards, local_len: int):
    mine, _ = state_passing.chunks(shards.layout, shards.group, local_len)
    return mine


def _conv(original, shards: Shards, hidden_states, weight, bias=None, *args, **kwargs):
    """Causal depthwise conv1d; hidden_states (B, C, T), weight (C, k): each chunk gets the k - 1
    inputs before it (its halo) from whichever rank holds them."""
    width = weight.shape[-1] - 1
    local_len = hidden_states.shape[-1]
    mine = _local_chunks(shards, local_len)
    if width == 0:
        return original(hidden_states, weight, bias, *args, **kwargs)
    tails = [hidden_states[..., seg.rows][..., -width:] if seg.length >= width else
             hidden_states.new_zeros(hidden_states.shape[:-1] + (width,)) for seg in mine]
    halos = state_passing.halo(tails, width, shards.layout, shards.group, local_len, phase="conv_halo")
    outs = [original(torch.cat([halo, hidden_states[..., seg.rows]], dim=-1), weight, bias, *args, **kwargs)
            [..., width:] for seg, halo in zip(mine, halos)]
    return torch.cat(outs, dim=-1)


def _gated_delta_rule(original, shards: Shards, query, key, value, g, beta, *args, initial_state=None,
                      output_final_state=False, cu_seqlens=None, **kwargs):
    """Gated delta rule; query/key (B, T, Hk, dk), value (B, T, Hv, dv), g (B, T, Hv) or, Kimi's,
    (B, T, Hv, dk), beta (B, T, Hv); state (B, Hv, dk, dv), transition (B, Hv, dk, dk) acting on the
    state's dk side."""
    _refuse_state_arguments("the gated delta rule", initial_state, output_final_state, cu_seqlens)
    batch, local_len, heads, dv = value.shape
    dk = key.shape[-1]
    identity = torch.eye(dk, dtype=torch.float32, device=value.device).expand(batch, heads, dk, dk)
    start = torch.cat([identity.new_zeros(batch, heads, dk, dv), identity], dim=-1)
    outs, coefficients, finals, transitions = [], [], [], []
    for seg in _local_chunks(shards, local_len):
        rows = seg.rows
        value_ext = torch.cat([value[:, rows], value.new_zeros(batch, seg.length, heads, dk)], dim=-1)
        out, final = original(query[:, rows], key[:, rows], value_ext, g[:, rows], beta[:, rows], *args,
                              initial_state=start, output_final_state=True, **kwargs)
        outs.append(out[..., :dv])
        coefficients.append(out[..., dv:])
        finals.append(final[..., :dv].float())
        transitions.append(final[..., dv:].float())
    starts = state_passing.initial_states(finals, transitions, torch.matmul, shards.layout, shards.group,
                                          local_len, phase="gated_delta_rule_state")
    out = [o + torch.einsum("bthk,bhkv->bthv", c.float(), s).to(o.dtype)
           for o, c, s in zip(outs, coefficients, starts)]
    return torch.cat(out, dim=1), None


def _mamba2_scan(original, shards: Shards, hidden_states, dt, A, B, C, chunk_size=None, *args,
                 initial_states=None, return_final_states=False, **kwargs):
    """Mamba2's chunked scan (scalar decay per head); hidden_states (B, T, H, P), B/C (B, T, G, N);
    state (B, H, P, N), transition (B, H, N, N) acting on the state's N side (a multiple of I)."""
    _refuse_state_arguments("the Mamba2 scan", initial_states, return_final_states, kwargs.get("seq_idx"))
    batch, local_len, heads, head_dim = hidden_states.shape
    n = B.shape[-1]
    identity = torch.eye(n, dtype=torch.float32, device=hidden_states.device).expand(batch, heads, n, n)
    start = torch.cat([identity.new_zeros(batch, heads, head_dim, n), identity], dim=2)
    outs, coefficients, finals, transitions = [], [], [], []
    for seg in _local_chunks(shards, local_len):
        rows = seg.rows
        x_ext = torch.cat([hidden_states[:, rows], hidden_states.new_zeros(batch, seg.length, heads, n)], dim=-1)
        out, final = original(x_ext, dt[:, rows], A, B[:, rows], C[:, rows], chunk_size, *args,
                              initial_states=start, return_final_states=True, **kwargs)
        outs.append(out[..., :head_dim])
        coefficients.append(out[..., head_dim:])
        finals.append(final[:, :, :head_dim].float())
        transitions.append(final[:, :, head_dim:].float())
    starts = state_passing.initial_states(finals, transitions, lambda m, h: h @ m, shards.layout, shards.group,
                                          local_len, phase="mamba2_state")
    out = [o + torch.einsum("bthj,bhpj->bthp", c.float(), s).to(o.dtype)
           for o, c, s in zip(outs, coefficients, starts)]
    return torch.cat(out, dim=1)


def _mamba_scan(original, shards: Shards, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                delta_softplus=False, return_last_state=False, *args, **kwargs):
    """Mamba's selective scan (a decay per channel and state entry); hidden_states/dt/z (B, D, T),
    A (D, N), B/C (B, N, T); state (B, D, N), transition (B, D, N) elementwise. It takes no starting
    state, so each chunk's decays are computed here: exp(A * cumsum(dt)) after the scan's own bias
    and softplus."""
    _refuse_state_arguments("the Mamba scan", None, return_last_state, None)
    local_len = hidden_states.shape[-1]
    steps = dt if delta_bias is None else dt + delta_bias.to(dt.dtype)[..., None]
    steps = F.softplus(steps) if delta_softplus else steps
    mine = _local_chunks(shards, local_len)
    outs, decays, finals, transitions = [], [], [], []
    for seg in mine:
        rows = seg.rows
        out, final = original(hidden_states[..., rows], dt[..., rows], A, B[..., rows], C[..., rows], D,
                              None if z is None else z[..., rows], delta_bias, delta_softplus, True, *args, **kwargs)
        cumulative = steps[..., rows].float().cumsum(-1)                       # (B, D, t)
        decay = torch.exp(A.float()[None, :, None, :] * cumulative[..., None])  # (B, D, t, N)
        outs.append(out)
        decays.append(decay)
        finals.append(final.float())
        transitions.append(decay[:, :, -1])
    starts = state_passing.initial_states(finals, transitions, torch.mul, shards.layout, shards.group,
                                          local_len, phase="mamba_state")
    result = []
    for seg, out, decay, start in zip(mine, outs, decays, starts):
        rows = seg.rows
        correction = torch.einsum("bdtn,bdn,bnt->bdt", decay, start, C[..., rows].float())
        if z is not None:
            correction = correction * F.silu(z[..., rows].float())
        result.append(out + correction.to(out.dtype))
    return torch.cat(result, dim=-1)


def _from_true_starts(shards: Shards, local_len: int, phase: str, final_and_transition, run_from) -> list:
    """The scheme of the mixers whose output is not affine in their state: each chunk runs from zero
    for `final_and_transition(seg)` -> (its final state as true sums, its transition: a factor, same
    shape), the states are passed in one all-gather, and `run_from(seg, start)` runs the chunk again
    from the state it truly starts from. Returns run_from's results, one per local chunk."""
    mine = _local_chunks(shards, local_len)
    finals, transitions = zip(*(final_and_transition(seg) for seg in mine))
    starts = state_passing.initial_states(finals, transitions, torch.mul, shards.layout, shards.group, local_len,
                                          phase=phase)
    return [run_from(seg, start) for seg, start in zip(mine, starts)]


def _rwkv_wkv(original, shards: Shards, time_decay, time_first, key, value, state=None, return_state=False):
    """RWKV-4's WKV; key/value (B, T, C), time_decay/time_first (C,). Its state is (numerator,
    denominator, running max), the true sums being numerator * e^max and denominator * e^max, each
    decaying by e^w per token (w = -exp(time_decay)). The output divides by the state, so it is not
    affine in it: each chunk runs twice, from zero to learn its final state, then from the state it
    really starts from. The states are combined as true sums in float64 (no overflow below e^700)."""
    _refuse_state_arguments("the RWKV WKV", state, return_state, None)
    decay = -torch.exp(time_decay.double())                       # (C,) per token, in log space

    def final_and_transition(seg):
        _, (numerator, denominator, running_max) = original(time_decay, time_first, key[:, seg.rows],
                                                             value[:, seg.rows], return_state=True)
        scale = torch.exp(running_max.double())
        final = torch.stack([numerator.double() * scale, denominator.double() * scale])  # (2, B, C)
        return final, torch.exp(decay * seg.length).expand_as(final)

    def run_from(seg, start):
        # Back to the stabilised form: max = log(denominator) (the denominator sums positive terms).
        running_max = torch.log(start[1].clamp_min(1e-150))
        stabilised = [(start[0] / start[1].clamp_min(1e-150)).float(), (start[1] > 0).float(),
                      torch.where(start[1] > 0, running_max, torch.full_like(running_max, -1e38)).float()]
        return original(time_decay, time_first, key[:, seg.rows], value[:, seg.rows], state=stabilised)[0]

    outs = _from_true_starts(shards, key.shape[1], "rwkv_state", final_and_transition, run_from)
    return torch.cat(outs, dim=1), None


class TokenShift(torch.nn.Module):
    """RWKV's time shift (each token sees the one before it: ZeroPad2d((0, 0, 1, -1)) on (B, T, C)),
    with each chunk's first token seeing the last token of the chunk before it, wherever it is."""

    def __init__(self, shards: Shards):
        super().__init__()
        self.shards = shards

    def forward(self, hidden):
        if self.shards.world == 1:
            return F.pad(hidden, (0, 0, 1, -1))
        mine = _local_chunks(self.shards, hidden.shape[1])
        tails = [hidden[:, seg.rows][:, -1:] for seg in mine]
        halos = state_passing.halo(tails, 1, self.shards.layout, self.shards.group, hidden.shape[1],
                                   phase="token_shift")
        return torch.cat([torch.cat([halo, hidden[:, seg.rows][:, :-1]], dim=1) for seg, halo in zip(mine, halos)],
                         dim=1)


def _shard_token_shifts(model: torch.nn.Module, shards: Shards) -> None:
    """Replace each RWKV-style `time_shift` (a ZeroPad2d shifting one token) with a TokenShift."""
    for module in model.modules():
        shift = getattr(module, "time_shift", None)
        if isinstance(shift, TokenShift) or (isinstance(shift, torch.nn.ZeroPad2d) and
                                             tuple(shift.padding) == (0, 0, 1, -1)):
            module.time_shift = TokenShift(shards)


# ---- mixers whose recurrence is inline in their module's forward: the forward runs once per chunk ----

class _StartState:
    """The cache a MiniMax lightning-attention layer reads its starting state from (and whose update
    it makes at the end, dropped): with a state, the layer runs its token-by-token recurrence."""

    def __init__(self, state: torch.Tensor):
        self.state, self.read = state, False

    def get_linear_cache(self, layer_idx):
        self.read = True
        return self.state

    def set_linear_cache(self, layer_idx, value):
        pass


def _cache_keyword(forward) -> str:
    """The name a layer's forward takes its cache by (transformers renamed past_key_values to cache)."""
    parameters = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise ValueError(f"{getattr(forward, '__qualname__', forward)} takes neither cache nor past_key_values: this "
                     "transformers release arranges the layer differently from what burst knows")


def _lightning_attention(module, forward, shards: Shards, hidden_states, *args, **kwargs):
    """MiniMax's lightning attention (linear attention with a decay per head, its loop inline in the
    forward); hidden_states (B, T, D); state (B, H, d, d), decaying by exp(-slope) per token. Each
    chunk runs the layer twice: from zero (its final state: the forward returns it), then from the
    state it truly starts from (handed in as the cache the layer reads)."""
    if shards.world == 1:
        return forward(hidden_states, *args, **kwargs)
    keyword = _cache_keyword(forward)
    if any(kwargs.pop(name, None) is not None for name in ("cache", "past_key_values")):
        raise _cache_refused(module, shards.world)
    state_dtype = {}  # the layer's own state dtype (its value projection's, under autocast too)

    def final_and_transition(seg):
        _, final = forward(hidden_states[:, seg.rows], *args, **kwargs)
        state_dtype["value"] = final.dtype
        return final.float(), torch.exp(-module.slope_rate.float() * seg.length).expand_as(final)

    def run_from(seg, start):
        given = _StartState(start.to(state_dtype["value"]))
        out = forward(hidden_states[:, seg.rows], *args, **{keyword: given}, **kwargs)[0]
        if not given.read:  # the layer ran from zero: wrong, so loud
            raise RuntimeError(f"{type(module).__name__} did not read the starting state burst handed it; this "
                               "transformers release arranges the layer differently from what burst knows")
        return out

    outs = _from_true_starts(shards, hidden_states.shape[1], "lightning_state", final_and_transition, run_from)
    return torch.cat(outs, dim=1), None


def _mlstm(module, forward, shards: Shards, query, key, value, igate, fgate, c_initial=None, n_initial=None,
           m_initial=None, return_last_states=None, mode=None):
    """xLSTM's mLSTM backend; query/key (B, H, T, dk), value (B, H, T, dv), igate/fgate (B, H, T).
    State (c, n, m): the true cell and normaliser are c e^m (B, H, dk, dv) and n e^m (B, H, dk),
    each decaying by sigmoid(fgate) per token; the output divides by the normaliser, so each chunk
    runs twice (from zero for its final state, then from its true start). The states are combined as
    true sums in float64 and scaled back by their largest entry."""
    _refuse_state_arguments("the mLSTM", c_initial, False, None)

    def final_and_transition(seg):
        rows = (slice(None), slice(None), seg.rows)
        _, (c, n, m) = forward(query[rows], key[rows], value[rows], igate[rows], fgate[rows],
                               return_last_states=True, mode=mode)
        scale = torch.exp(m.double())[..., None]                                    # (B, H, 1, 1)
        final = torch.cat([c.double(), n.double()[..., None]], dim=-1) * scale       # (B, H, dk, dv + 1)
        decay = torch.exp(F.logsigmoid(fgate[rows].double()).sum(-1))[..., None, None]
        return final, decay.expand_as(final)

    def run_from(seg, start):
        rows = (slice(None), slice(None), seg.rows)
        largest = start.abs().amax(dim=(-2, -1))                                     # (B, H)
        m = torch.where(largest > 0, torch.log(largest.clamp_min(1e-300)), torch.zeros_like(largest))
        scaled = start / torch.exp(m)[..., None, None]
        c, n = scaled[..., :-1].to(query.dtype), scaled[..., -1].to(query.dtype)
        return forward(query[rows], key[rows], value[rows], igate[rows], fgate[rows], c_initial=c, n_initial=n,
                       m_initial=m[..., None].to(query.dtype), return_last_states=True, mode=mode)[0]

    outs = _from_true_starts(shards, query.shape[2], "mlstm_state", final_and_transition, run_from)
    return torch.cat(outs, dim=2), None


def _rg_lru(module, forward, shards: Shards, activations, position_ids):
    """RecurrentGemma's RG-LRU; activations (B, T, W). A diagonal linear recurrence h_t = a_t h_{t-1} + x_t
    (a_t = 0 where a document starts), run by the module from `module.recurrent_states`: its outputs
    and final state are affine in that start, so each chunk runs from 0 and from 1 (the difference is
    its transition per channel), then from the state it truly starts from."""
    if activations.shape[1] == 1:
        raise ValueError(f"{type(module).__name__}: decoding (one token) with the sequence split across "
                         f"{shards.world} ranks is not supported for recurrent layers")

    def from_state(seg, start):
        module.recurrent_states = start
        try:
            out = forward(activations[:, seg.rows], position_ids[:, seg.rows])
            return out, module.recurrent_states
        finally:
            module.recurrent_states = None

    def final_and_transition(seg):
        zeros = activations.new_zeros(activations.shape[0], activations.shape[2], dtype=torch.float32)
        _, final = from_state(seg, zeros)
        _, final_from_ones = from_state(seg, zeros + 1)
        return final, final_from_ones - final

    def run_from(seg, start):
        # A third run rather than out(0) + (out(1) - out(0)) * start: the module returns its outputs in
        # the activations' dtype, and in bf16 that difference would lose the decays' precision.
        return from_state(seg, start)[0]

    outs = _from_true_starts(shards, activations.shape[1], "rg_lru_state", final_and_transition, run_from)
    return torch.cat(outs, dim=1)


_TAKEN_OVER = {"MiniMaxLightningAttention": _lightning_attention, "xLSTMBackend": _mlstm,
               "RecurrentGemmaRglru": _rg_lru}


def _causal_depthwise(x, weight, bias):
    """x (B, C, T) through a depthwise convolution of weight (C, k), the k - 1 inputs before each
    output taken from x itself: causal_conv1d_fn's arithmetic, for _conv."""
    return F.conv1d(F.pad(x, (weight.shape[-1] - 1, 0)), weight[:, None, :], bias, groups=x.shape[1])


def _shard_convolution_modules(model: torch.nn.Module, shards: Shards) -> None:
    """RecurrentGemma's temporal convolution is an nn.Conv1d module (depthwise, padded k - 1 on both
    sides, the caller keeps the first T outputs): its forward becomes _conv's, each chunk with its halo."""
    for block in model.modules():
        conv = getattr(block, "conv_1d", None)
        if type(block).__name__ != "RecurrentGemmaRecurrentBlock" or not isinstance(conv, torch.nn.Conv1d):
            continue
        if conv.groups != conv.in_channels or conv.padding != (conv.kernel_size[0] - 1,):
            raise ValueError(f"{type(block).__name__}.conv_1d is not the depthwise convolution burst knows")

        def forward(x, conv=conv):
            return _conv(_causal_depthwise, shards, x, conv.weight[:, 0, :], conv.bias)

        conv.forward = forward


def _capture_position_ids(model: torch.nn.Module) -> None:
    """Attention modules that take position_ids but do not hand them to the attention function
    (RecurrentGemma's): a pre-hook keeps them on the module, where burst's attention function reads
    them (it needs the shard's global positions). Once per module."""
    for module in model.modules():
        forward = type(module).forward
        if not type(module).__name__.endswith("Attention") or getattr(module, "_burst_captures_positions", False):
            continue
        signature = inspect.signature(forward)
        if "position_ids" not in signature.parameters:
            continue

        def keep(mod, args, kwargs, signature=signature):
            bound = signature.bind_partial(mod, *args, **kwargs).arguments
            mod._burst_position_ids = bound.get("position_ids")

        module.register_forward_pre_hook(keep, with_kwargs=True)
        module._burst_captures_positions = True


def _take_over(module: torch.nn.Module, shards: Shards) -> None:
    """module.forward runs through its _TAKEN_OVER function (the class's own forward, per chunk)."""
    forward = type(module).forward.__get__(module)
    module.forward = functools.partial(_TAKEN_OVER[type(module).__name__], module, forward, shards)


def _refuse_state_arguments(what: str, initial, final, varlen) -> None:
    if initial is not None or final:
        raise ValueError(f"{what} was called with a starting or final state (a cache) while its sequence is split "
                         "across ranks; burst passes the state itself and supports no cache here")
    if varlen is not None:
        raise ValueError(f"{what} was called with variable-length sequences (cu_seqlens / seq_idx) while its "
                         "sequence is split across ranks; burst does not split packed sequences for recurrent layers")


_SHARDED = {
    "causal_conv1d_fn": _conv,
    "torch_chunk_gated_delta_rule": _gated_delta_rule,
    # Kimi delta attention: the gated delta rule with a decay per key channel; the state's transition
    # still acts on its key side, so the same identity columns read it off.
    "chunk_kimi_delta_attention": _gated_delta_rule,
    "mamba2_chunk_scan": _mamba2_scan,
    "mamba_selective_scan": _mamba_scan,
    "rwkv_linear_attention": _rwkv_wkv,
}
