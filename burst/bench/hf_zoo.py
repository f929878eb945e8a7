"""The zoo: every causal-LM family transformers ships, built tiny from its own config class, run on
burst's backend against the same model's eager attention in one process.

Each family ends in one of:
  exact    logits and loss match eager attention (max abs difference <= TOLERANCE)
  refused  burst raised a clear error (ValueError / NotImplementedError raised inside burst), or
           transformers itself would not build the model with a custom attention implementation
  silent   ran and differs, with no error: the outcome burst must never have
  crash    any other exception (a traceback from the model or transformers)
  skip     the family could not be built tiny, or its eager model does not run on token ids alone

    from burst.bench.hf_zoo import families, run_zoo
    rows = run_zoo(families())   # on every rank of the world alike: {family: {setting: Outcome}}

`tiny_config(model_type)` shrinks a family's default config (its attention features kept: GQA, sliding
layers, sinks, softcap, q/k norms, MLA head dims, chunked attention): every size attribute the config
has is set small, and a per-layer pattern (`layer_types`) keeps one layer of each kind.
tests/test_hf_zoo.py runs it at 1 and 2 ranks; benchmarks/hf_zoo.py writes the table. A tool for the
tests and the benchmarks of burst.integrations.transformers, not part of it.
"""

from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

TOLERANCE = 2e-4
SEQ_LEN, VOCAB, MAX_PARAMETERS = 128, 256, 30_000_000

# config attribute -> tiny value, applied where the family's config has the attribute as a number (so a
# feature its default leaves off, such as sliding_window=None, stays off)
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "n_embed": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16, "attention_head_dim": 16,
    "intermediate_size": 128, "ffn_dim": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "n_inner": 128,
    "ffn_hidden_size": 128, "d_ff": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "moe_ffn_hidden_size": 32,
    "max_position_embeddings": 512, "n_positions": 512,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "first_k_dense_replace": 1, "sliding_window": 32, "attention_chunk_size": 64,
    # recurrent mixers (the backend's layers/mixers): value heads narrower than keys, scan chunks shorter than a shard
    "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 16, "linear_num_heads": 4,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "n_mamba_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16,
    "mamba_headdim": 16, "mamba_d_state": 16, "ssm_state_size": 16, "state_size": 16, "mamba_dt_rank": 8,
    "mamba_chunk_size": 16, "chunk_size": 16, "n_groups": 1, "mamba_n_groups": 1,
}
# Families whose default config SIZES cannot shrink consistently, or whose default has none of the layers that
# make the family what it is (LFM2's default is all attention): their recurrent / convolutional layers kept
# tiny, with scan chunks shorter than a shard so a shard spans several of them.
HYBRID_SIZES = {
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8},  # heads x head_dim must be hidden_size x expand
    "bamba": {"attn_layer_indices": [1]},
    "falcon_h1": {"mamba_d_ssm": 128},
}
ZEROED = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "dropout", "hidden_dropout",
          "hidden_dropout_prob", "resid_pdrop", "embd_pdrop", "activation_dropout")


@dataclass
class Outcome:
    family: str
    outcome: str          # exact | refused | silent | crash | skip
    detail: str = ""      # the error's first line, the difference, or why skipped
    difference: float | None = None


def families() -> list[str]:
    """Every model_type of transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# Size attributes left at the family's default when a config refuses the full set of SIZES (per-layer
# attributes, head dims tied to rotary dims, validated layer counts): each retry keeps one group more.
_KEPT_IN_TURN = (("head_dim", "kv_channels", "attention_head_dim"),
                 ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "qk_rope_head_dim", "qk_nope_head_dim",
                  "v_head_dim", "q_lora_rank", "kv_lora_rank"),
                 ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                  "layer_types", "intermediate_size", "moe_intermediate_size", "first_k_dense_replace"))
RETRIES = tuple(sum(_KEPT_IN_TURN[:i], ()) for i in range(len(_KEPT_IN_TURN) + 1))


def tiny_config(model_type: str, keep_default: tuple[str, ...] = ()):
    """The family's config class, its default shrunk to SIZES but for the attributes in keep_default
    (raises when the config refuses the values)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    text = default.get_text_config(decoder=True)
    key = next((k for k, v in vars(default).items() if v is text and text is not default), None)
    sub_cls = type(text) if key is not None else cls
    overrides = {k: v for k, v in _overrides(text, sub_cls).items() if k not in keep_default}
    overrides.update(HYBRID_SIZES.get(model_type, {}))
    if key is None:
        config = cls(**overrides)
    else:  # a composite config: shrink its decoder's sub-config
        config = cls(**{key: {**text.to_dict(), **overrides}})
    target = config.get_text_config(decoder=True)
    for attr in ZEROED:
        if isinstance(getattr(target, attr, None), float):
            setattr(target, attr, 0.0)
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(target, attr, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(target, attr, 0)
    return config


def _overrides(text, cls) -> dict:
    """SIZES for the attributes the config has and can be given (not read-only properties), layer
    counts deep enough for one layer of each kind of its per-layer pattern."""
    out = {key: value for key, value in SIZES.items() if _has_number(text, key) and _settable(cls, key)}
    if "qk_rope_head_dim" in out and "head_dim" in out:  # MLA: head_dim names the rotary part
        out["head_dim"] = out["qk_rope_head_dim"]
    if "kv_lora_rank" in out:  # MLA expands its latent to every query head: as many KV heads as heads
        for key in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
            if key in out:
                out[key] = out.get("num_attention_heads", 4)
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types:
        kinds = list(dict.fromkeys(layer_types))
        depth = max(2, max(list(layer_types).index(kind) for kind in kinds) + 1)
        if _settable(cls, "layer_types"):
            out["layer_types"] = list(layer_types[:depth])
        for key in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers"):
            if key in out:
                out[key] = depth
    return out


def _settable(cls, key: str) -> bool:
    key = getattr(cls, "attribute_map", {}).get(key, key)  # e.g. Bamba's layer_types names a read-only property
    attribute = getattr(cls, key, None)
    return not (isinstance(attribute, property) and attribute.fset is None)


def _has_number(config, key) -> bool:
    value = getattr(config, key, None)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Skip(Exception):
    """The family cannot be built tiny (it is listed as skipped, with the reason)."""


class _NotBuilt(Exception):
    """transformers itself raises when the family is built with a custom attention implementation."""


def build(model_type: str, attn_implementation: str, ids: torch.Tensor, positions: torch.Tensor):
    """(eager model's output on ids, the same weights on attn_implementation, the eager model) for
    the first of RETRIES whose tiny config builds and runs eagerly; raises the first retry's error
    otherwise."""
    from transformers import AutoModelForCausalLM

    first = None
    for keep_default in RETRIES:
        try:
            config = tiny_config(model_type, keep_default)
            with torch.device("meta"):  # counted before any memory is spent: a size SIZES missed stays huge
                parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(copy.deepcopy(config)).parameters())
            if parameters > MAX_PARAMETERS:  # later retries keep more defaults: no smaller
                reason = f"not tiny: {parameters / 1e6:.0f}M parameters (sub-models SIZES does not reach)"
                raise _Skip(reason if first is None else f"{reason}; with every size set: {_first_line(first)}")
            torch.manual_seed(0)
            eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
            with torch.no_grad():
                expected = eager(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
        except _Skip:
            raise
        except Exception as err:  # noqa: BLE001 - the family's own limits; the next retry keeps more defaults
            first = first or err
            continue
        try:
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
        except Exception as err:  # noqa: BLE001 - transformers' own refusal of a custom attention name
            raise _NotBuilt(_first_line(err)) from err
        model.load_state_dict(eager.state_dict())
        return expected, model.eval(), eager
    raise first


def run_family(model_type: str, name: str, layout: str, group=None, built=None) -> tuple[Outcome, tuple | None]:
    """One family on the registered burst backend `name` (layout `layout`) over `group`, on every
    rank: (its Outcome, what `build` returned, to run again under another name, or None).
    built: that from an earlier call, with the model switched to `name`."""
    ids = torch.randint(3, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ_LEN)[None]
    try:
        built = built if built is not None else build(model_type, name, ids, positions)
    except _Skip as err:
        return Outcome(model_type, "skip", str(err)), None
    except _NotBuilt as err:
        return Outcome(model_type, "refused", f"by transformers, at from_config: {err}"), None
    except Exception as err:  # noqa: BLE001 - any failure to build or run eagerly is the family's, not burst's
        return Outcome(model_type, "skip", f"eager model does not run tiny on token ids: {_first_line(err)}"), None
    expected, model, _ = built
    return _compare(model_type, expected, model, ids, positions, layout, group), built


def _compare(model_type, expected, model, ids, positions, layout, group) -> Outcome:
    from ..integrations import transformers as bt

    try:
        batch = bt.shard_batch({"input_ids": ids, "labels": ids, "position_ids": positions}, group=group,
                               layout=layout, model=model)
        with torch.no_grad():
            got = model(**batch, use_cache=False)
        logits = _unshard(got.logits, group, layout)
        loss = bt.reduce_loss(got.loss, group) if got.loss is not None else None
    except Exception as err:  # noqa: BLE001 - classified: burst's own clear error, or a crash
        kind = "refused" if _raised_by_burst(err) else "crash"
        return Outcome(model_type, kind, _first_line(err))
    difference = (logits.double() - expected.logits.double()).abs().max().item()
    if loss is not None and expected.loss is not None:
        difference = max(difference, abs(loss.item() - expected.loss.item()))
    if difference <= TOLERANCE:
        return Outcome(model_type, "exact", "", difference)
    return Outcome(model_type, "silent", f"max abs difference {difference:.2e}", difference)


def twin_models(model_type: str, attn_implementation: str):
    """(the family's tiny model with eager attention, the same weights on `attn_implementation`), in
    training mode: for a training step's comparison (train_step_errors)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
    model.load_state_dict(eager.state_dict())
    return eager, model


def train_step_errors(model_type: str, name: str, layout: str, group=None, seq_len: int = 64,
                      checkpointing: bool = False) -> dict:
    """One forward + backward of the family's tiny model (batch 2) split over `group` on the burst
    backend `name`, against the same model in this process with eager attention: the max abs
    difference of the logits and the loss, and gradient_error over every parameter's gradient.
    checkpointing: the split model recomputes each layer in the backward. Call on every rank of the
    group alike."""
    from .. import layout as layout_mod
    from ..integrations import transformers as bt

    eager, model = twin_models(model_type, name)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
    expected = eager(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()
    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, group=group, layout=layout, model=model)
    got = model(**batch, use_cache=False)
    got.loss.backward()
    bt.reduce_gradients(model, group)
    logits = layout_mod.unshard(got.logits.contiguous(), group=group, layout=layout, dim=1)
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()) if q.grad is not None]
    return {"logits": (logits - expected.logits).abs().max().item(),
            "loss": abs(bt.reduce_loss(got.loss, group).item() - expected.loss.item()),
            "gradients": gradient_error(pairs), "gradient_count": len(pairs)}


def gradient_error(pairs) -> float:
    """The largest of each (got, expected) gradient pair's max abs difference relative to the expected
    gradient's max, or to 1/100 of the largest expected gradient where that is more: fp32 rounding of
    the sums is relative to the whole model's scale, not to a parameter whose gradient is near zero."""
    floor = 1e-2 * max(q.abs().max().item() for _, q in pairs)
    return max((p - q).abs().max().item() / max(q.abs().max().item(), floor) for p, q in pairs)


def _unshard(local: torch.Tensor, group, layout: str) -> torch.Tensor:
    from .. import layout as layout_mod

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    return local if world == 1 else layout_mod.unshard(local.contiguous(), group=group, layout=layout, dim=1)


def _raised_by_burst(err: BaseException) -> bool:
    """A ValueError / NotImplementedError / TimeoutError raised inside the burst package."""
    if not isinstance(err, (ValueError, NotImplementedError, TimeoutError)):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(package + os.sep)


def _first_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().split("\n")[0]
    return text if len(text) <= 160 else text[:157] + "..."


def run_zoo(model_types, group=None, strategy: str = "burst",
            layouts=("contiguous", "zigzag")) -> dict[str, dict[str, Outcome]]:
    """Every family at 1 rank and, on a world of G > 1 ranks, at G ranks in each of `layouts`:
    {family: {setting: Outcome}}. Call on every rank of the group alike (the 1-rank setting runs on a
    group of this rank alone, so each rank checks it too)."""
    from ..integrations import transformers as bt

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:  # every rank creates every one-rank group, in the same order
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        alone = [dist.new_group([r]) for r in ranks][dist.get_rank(group)]
        names = {"1 rank": bt.register(f"zoo_{strategy}_alone", strategy=strategy, group=alone)}
        for layout in layouts:
            names[f"{world} ranks {layout}"] = bt.register(f"zoo_{strategy}_{layout}", strategy=strategy,
                                                           layout=layout, group=group)
    else:
        names = {"1 rank": bt.register(f"zoo_{strategy}_alone", strategy=strategy, group=group)}
    groups = {setting: bt.BACKENDS[name].group for setting, name in names.items()}
    return {family: _family_in_every_setting(family, names, groups) for family in model_types}


def _family_in_every_setting(model_type: str, names: dict, groups: dict) -> dict[str, Outcome]:
    """One build of the family, run under each registered name (switched with transformers'
    set_attn_implementation; a family that cannot switch is built again). A family that cannot be
    built has that outcome in every setting."""
    outcomes, built = {}, None
    for setting, name in names.items():
        layout = "contiguous" if setting == "1 rank" else setting.rsplit(" ", 1)[-1]
        if built is not None:
            built[1].set_attn_implementation(name)
            if built[1].config._attn_implementation != name:
                built = None
        outcomes[setting], built = run_family(model_type, name, layout, groups[setting], built)
        if built is None and (outcomes[setting].outcome == "skip" or "at from_config" in outcomes[setting].detail):
            return {s: outcomes[setting] for s in names}
    return outcomes


def table(rows: dict[str, dict[str, Outcome]]) -> str:
    """A Markdown table: family, then one column per setting (e.g. "1 rank", "2 ranks zigzag")."""
    settings = list(next(iter(rows.values())))
    head = "| family | " + " | ".join(settings) + " |"
    lines = [head, "|---" * (len(settings) + 1) + "|"]
    for family, by_setting in rows.items():
        cells = []
        for setting in settings:
            o = by_setting[setting]
            cells.append(o.outcome + (f": {o.detail.replace('|', '/')}" if o.detail and o.outcome != "exact" else ""))
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def zoo_world(rank: int, world: int, model_types=None,
              layouts=("contiguous", "zigzag")) -> dict[str, dict[str, Outcome]]:
    """run_zoo on every family (or `model_types`) in `layouts`, as one rank of a local world
    (burst.launch.spawn_world)."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()  # tiny configs trip many of the families' own warnings
    warnings.filterwarnings("ignore")
    return run_zoo(model_types or families(), layouts=layouts)
