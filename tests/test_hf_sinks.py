"""gpt-oss (attention sinks through `s_aux`, sliding and full layers) and the other s_aux families
transformers ships (flint, granite_swa, granitemoe_swa, mimo_v2_flash, from the zoo's tiny configs)
train and generate on burst exactly as on one process with eager attention: logits, loss, every
parameter's gradient (the sinks' included), and generate()'s tokens, zigzag: every family at 2 ranks, gpt-oss
(sliding and full layers) at 4 ranks too (the other families hand burst the same s_aux).

Also the deny-by-default contract of the backend: an unknown keyword, a relative-position bias and a
window the layer hides from burst are refused naming the keyword and the model (softcap is honoured:
tests/test_hf_flagships.py).
"""

from __future__ import annotations

import pytest
import torch

from cases import rel_err as _rel
from requires import transformers_or_skip
from world import results_by_world

transformers_or_skip()

SEQ, VOCAB, NEW = 48, 128, 5


def _gpt_oss():
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def _models(name):
    """(eager model on one process, the same weights on burst's `name`), sinks far from zero."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(_gpt_oss(), attn_implementation="eager")
    for layer in eager.model.layers:  # gpt-oss initializes sinks small: make them matter
        layer.self_attn.sinks.data = (
            torch.randn(4, generator=torch.Generator().manual_seed(layer.self_attn.layer_idx)) * 2
        )
    model = AutoModelForCausalLM.from_config(_gpt_oss(), attn_implementation=name)
    model.load_state_dict(eager.state_dict())
    return eager, model


SINK_FAMILIES = ("flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash")  # gpt_oss above, built by hand


def _zoo_models(family, name):
    """The zoo's tiny config of `family` (eager, burst's `name`), every sink set far from zero; None
    when this transformers release does not ship the family."""
    from burst.bench import hf_zoo

    if family not in hf_zoo.families():
        return None
    ids = torch.randint(3, hf_zoo.VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    _, model, eager = hf_zoo.build(family, name, ids, torch.arange(16)[None])
    state = eager.state_dict()
    for key, value in state.items():
        if key.endswith("sinks"):
            state[key] = torch.randn(value.shape, generator=torch.Generator().manual_seed(len(key))) * 2
    eager.load_state_dict(state)
    model.load_state_dict(state)
    return eager.train(), model.train()


def _train_and_generate(rank, world):
    import burst.integrations.transformers as bt

    name = bt.register("burst_sinks", strategy="burst", layout="zigzag")
    results = {"gpt_oss": _one_model(*_models(name), VOCAB)}
    for family in SINK_FAMILIES if world == 2 else ():
        models = _zoo_models(family, name)
        if models is not None:
            results[family] = _one_model(*models, 256)
    return results


def _one_model(eager, model, vocab):
    """Train step and greedy generate() of `model` (burst) against `eager` (one process)."""
    import burst
    import burst.integrations.transformers as bt

    ids = torch.randint(3, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = eager(input_ids=ids, labels=ids)
    expected.loss.backward()
    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, layout="zigzag", model=model)
    out = model(**batch)
    out.loss.backward()
    bt.reduce_gradients(model)
    logits = burst.unshard(out.logits.contiguous(), layout="zigzag", dim=1)
    reference = dict(eager.named_parameters())
    grads = {n: _rel(p.grad, reference[n].grad) for n, p in model.named_parameters() if p.grad is not None}
    sinks_effect = max(reference[n].grad.abs().max().item() for n in reference if n.endswith("sinks"))
    result = {
        "logits": _rel(logits, expected.logits),
        "loss": abs(bt.reduce_loss(out.loss).item() - expected.loss.item()),
        "grads": max(grads.values()),
        "sinks grads": max(v for n, v in grads.items() if n.endswith("sinks")),
        "sinks effect": sinks_effect,
        "grads compared": len(grads),
    }
    eager.eval(), model.eval()
    prompt = torch.randint(3, vocab, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = eager.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        got = model.generate(prompt, **bt.sharded_cache(model), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    result["tokens equal"] = torch.equal(want, got)
    return result


_results = results_by_world(_train_and_generate)


@pytest.mark.parametrize("world", [2, 4])  # 3 left out for the suite's time
def test_sink_families_train_and_generate_like_one_process(world):
    for rank, by_family in enumerate(_results(world)):
        assert "gpt_oss" in by_family and len(by_family) >= (3 if world == 2 else 1), by_family.keys()
        for family, r in by_family.items():
            assert r["logits"] < 1e-4 and r["loss"] < 1e-5, (family, rank, r)
            assert r["grads"] < 1e-4 and r["sinks grads"] < 1e-4, (family, rank, r)
            assert r["sinks effect"] > 1e-5 and r["grads compared"] > 10, (family, rank, r)  # the sinks are trained
            assert r["tokens equal"], (family, rank, r)


def test_keywords_burst_cannot_honour_are_refused_naming_them():
    import burst.integrations.transformers as bt
    from burst.integrations.transformers import ACCEPTED_KEYWORDS
    from transformers import AutoModelForCausalLM

    name = bt.register("burst_refusals")
    model = AutoModelForCausalLM.from_config(_gpt_oss(), attn_implementation=name)
    attention = model.model.layers[1].self_attn
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    positions = torch.arange(8)[None]
    for kwargs, words in (
        ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"),
        ({"position_bias": torch.ones(1, 4, 8, 8)}, "position_bias"),
        ({"cu_seq_lens_q": torch.tensor([0, 8])}, "cu_seq_lens_q"),
        ({"dropout": 0.1}, "dropout"),
    ):
        with pytest.raises(ValueError, match=words) as err:
            bt.burst_attention_forward(attention, q, kv, kv, None, position_ids=positions, **kwargs)
        assert "GptOssAttention" in str(err.value)
    assert "alibi_slopes" not in ACCEPTED_KEYWORDS
    out, _ = bt.burst_attention_forward(
        attention, q, kv, kv, None, position_ids=positions, dropout=0.0, softcap=None, s_aux=attention.sinks
    )
    assert out.shape == (1, 8, 4, 16)
    # the sliding layer's window comes from its config; a call that does not pass it is refused
    with pytest.raises(ValueError, match="sliding window"):
        bt.burst_attention_forward(model.model.layers[0].self_attn, q, kv, kv, None, position_ids=positions)
