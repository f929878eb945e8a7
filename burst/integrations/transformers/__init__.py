"""Run any Hugging Face transformers model's attention sequence-parallel through burst.

Registered through transformers' own interfaces (AttentionInterface for the attention function,
AttentionMaskInterface so transformers never builds an N x N mask): no model code is patched.

    import burst.integrations.transformers as bt

    name = bt.register(strategy="burst", layout="zigzag")        # -> "burst"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, layout="zigzag", model=model)
    loss = model(**batch).loss            # this rank's share of the global mean loss
    loss.backward()
    bt.reduce_gradients(model)            # sum the ranks' shares: the single-process gradients
    total = bt.reduce_loss(loss)          # the single-process mean loss, on every rank

Every rank runs the model on its shard of the sequence. `shard_batch` gives each rank its tokens
with `position_ids` at their *global* positions (so RoPE is right under zigzag / striped) and labels
shifted on the global sequence. Packed sequences (position_ids restarting at 0 for each document in
a row, transformers' packing convention) become burst's `cu_seqlens`, computed on the global
positions, so packed training needs no padding. What the backend cannot do raises on every rank:
padding masks with holes, dropout and `output_attentions=True`. Generation: `model.generate(ids,
**sharded_cache(model))` (`cache=ShardedCache(model)` from transformers 5.24 on, `past_key_values=`
before) prefills sequence-parallel and decodes on a sharded KV cache (generate.py); generate()
without it raises. FSDP2: `fully_shard(model)` here, or torch's own, with
`reduce_gradients` (which sees FSDP-managed gradients). Under torch.autocast q, k, v run in the
autocast dtype. layout="doc_zigzag" / "doc_contiguous" cut each packed document on its own.
Hybrid models (gated delta net, Mamba / Mamba2 layers, short convolutions: FAMILIES) pass their
recurrent state across ranks once `shard_mixers(model, group, layout)` (or shard_batch(...,
model=model)) has hooked them; until then more than one rank is refused. Training loops:
`SequenceParallelTrainer` (transformers' Trainer) and `SequenceParallel` (a hand-written accelerate
loop).

This file is the package's face: it only gathers the public names. Inside, each part imports only
the parts listed before it:

    keywords.py           what the attention function accepts (ACCEPTED_KEYWORDS), layer kinds
    layers/               the layers that need more than attention across ranks: rope.py (rotary
                          embeddings whose frequencies depend on the length), mixers/ (recurrent and
                          convolutional layers, one module per kind, passing their state)
    backend/              the attention implementation: registry.py (registered names), checks.py
                          (whole-model refusals), features.py (each model feature's hand-off, one
                          entry each), attention.py (register, the attention and mask functions),
                          documents.py, batches.py (shard_batch), gradients.py (FSDP2)
    generate.py           ShardedCache: model.generate() on a sharded KV cache
    sequence_parallel.py  SequenceParallel, and the pieces the Trainer shares with it
    trainer.py            SequenceParallelTrainer

ShardedCache and SequenceParallelTrainer subclass transformers' classes (the Trainer imports
accelerate): they are imported on first use, so `import burst.integrations.transformers` does not.
"""

from __future__ import annotations

from .backend.attention import TESTED_TRANSFORMERS, burst_attention_forward, burst_attention_mask, register
from .backend.batches import check_same_batch, reduce_loss, shard_batch
from .backend.checks import check_backend_compatible, check_config, check_model
from .backend.documents import documents_from_positions
from .backend.gradients import fsdp_reduction, fully_shard, reduce_gradients
from .backend.registry import BACKENDS, Backend, backend_of
from .keywords import ACCEPTED_KEYWORDS, check_keywords, check_model_features, model_name
from .layers.mixers import FAMILIES, shard_mixers
from .sequence_parallel import SequenceParallel

__all__ = [
    "ACCEPTED_KEYWORDS",
    "BACKENDS",
    "Backend",
    "FAMILIES",
    "SequenceParallel",
    "SequenceParallelTrainer",
    "ShardedCache",
    "TESTED_TRANSFORMERS",
    "backend_of",
    "burst_attention_forward",
    "burst_attention_mask",
    "check_backend_compatible",
    "check_config",
    "check_keywords",
    "check_model",
    "check_model_features",
    "check_same_batch",
    "documents_from_positions",
    "fsdp_reduction",
    "fully_shard",
    "model_name",
    "reduce_gradients",
    "reduce_loss",
    "register",
    "shard_batch",
    "shard_mixers",
    "sharded_cache",
]


def __getattr__(attr: str):
    # ShardedCache and SequenceParallelTrainer subclass transformers' classes: imported on first use.
    try:
        if attr == "ShardedCache":
            from .generate import ShardedCache

            return ShardedCache
        if attr == "sharded_cache":
            from .generate import sharded_cache

            return sharded_cache
        if attr == "SequenceParallelTrainer":  # imports transformers' Trainer (and accelerate)
            from .trainer import SequenceParallelTrainer

            return SequenceParallelTrainer
    except ModuleNotFoundError as err:  # the extra is missing: say which install brings it
        if (err.name or "").partition(".")[0] not in ("transformers", "accelerate"):
            raise
        raise ImportError(
            f"{__name__}.{attr} needs transformers and accelerate: pip install "
            f"'transformers{TESTED_TRANSFORMERS}' 'accelerate>=1.1' (or, from a clone of burst, "
            "pip install '.[hf]')"
        ) from err
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
