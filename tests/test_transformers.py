"""Hugging Face transformers models on burst's attention backend, against the single-process model.

Models are built from configs with random weights (no download). One world per size (2 and 3: an even
and an odd size, 3 the more-than-two path); every strategy x layout, packed documents, sliding
windows, an AdamW step and the errors run in it.
"""

from __future__ import annotations

import copy
import io
import itertools
import warnings

import pytest
import torch

from cases import rel_err as _rel
from cases import tiny_decoder_config
from requires import transformers_or_skip
from world import results_by_world, run_torchrun, value_error_text

transformers_or_skip()

VOCAB = 64
COMBOS = (
    ("burst", "contiguous"),
    ("burst", "zigzag"),
    ("burst", "striped"),
    ("ring", "contiguous"),
    ("ring", "zigzag"),
    ("ring", "striped"),
    ("distflash", "contiguous"),
)


def _llama_config(**extra):
    return tiny_decoder_config("LlamaConfig", VOCAB, **extra)


def _models(config_fn, name):
    """(single-process model on SDPA, the same weights on burst's backend `name`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config_fn(), attn_implementation="sdpa")
    sharded = AutoModelForCausalLM.from_config(config_fn(), attn_implementation=name)
    sharded.load_state_dict(reference.state_dict())
    return reference, sharded


def _grads_error(model, reference):
    named = dict(reference.named_parameters())
    return max(_rel(p.grad, named[n].grad) for n, p in model.named_parameters())


def _parity(rank, world, strategy, layout):
    """Logits, loss and every parameter gradient of the sharded model vs the single-process one,
    then one AdamW step: the parameters after it."""
    import burst
    import burst.integrations.transformers as bt

    name = bt.register(f"burst-{COMBOS.index((strategy, layout))}", strategy=strategy, layout=layout)
    reference, model = _models(_llama_config, name)
    ids = torch.randint(0, VOCAB, (2, 8 * world), generator=torch.Generator().manual_seed(world))
    ref_out = reference(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, model=model)  # the registered layout, by default
    out = model(**batch)
    out.loss.backward()
    bt.reduce_gradients(model)
    errors = {
        "logits": _rel(burst.unshard(out.logits, layout=layout), ref_out.logits),
        "loss": abs(bt.reduce_loss(out.loss).item() - ref_out.loss.item()),
        "grads": _grads_error(model, reference),
    }
    lr = 1e-2
    for m in (reference, model):
        torch.optim.AdamW(m.parameters(), lr=lr).step()
    # Adam's first step moves each parameter by about lr * sign(grad): compare in units of lr.
    named = dict(reference.named_parameters())
    errors["params after AdamW"] = max((p - named[n]).abs().max().item() for n, p in model.named_parameters()) / lr
    # the whole model pickled (torch.save), with the hooks burst left on it, runs as before
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    with torch.no_grad():
        errors["pickled"] = _rel(torch.load(saved, weights_only=False)(**batch).logits, model(**batch).logits)
    return errors


def _packed(rank, world):
    """One row of three packed documents equals three separate single-process forwards."""
    import burst
    import burst.integrations.transformers as bt

    name = bt.register("burst-packed", strategy="burst", layout="zigzag")
    reference, model = _models(_llama_config, name)
    n = 8 * world
    lengths = (5, 7, n - 12)
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    out = model(**bt.shard_batch({"input_ids": ids, "position_ids": positions}, layout="zigzag", model=model))
    logits = burst.unshard(out.logits, layout="zigzag")
    worst, start = 0.0, 0
    with torch.no_grad():
        for length in lengths:
            alone = reference(input_ids=ids[:, start : start + length]).logits
            worst = max(worst, _rel(logits[:, start : start + length], alone))
            start += length
    return worst


def _packed_per_document(rank, world):
    """Packed documents cut one by one (doc_zigzag, the peers' THD convention): logits and every
    gradient equal one process running each document on its own (transformers' SDPA path does not
    mask packed documents), with the packed row's loss on the concatenated logits."""
    import burst.integrations.transformers as bt

    name = bt.register("burst-doc-zigzag", strategy="burst", layout="doc_zigzag")
    reference, model = _models(_llama_config, name)
    unit = 2 * world
    lengths = (unit, 2 * unit, 5 * unit)  # each a multiple of 2G; the last longer than a shard
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(9))
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    starts = [0, unit, 3 * unit]
    ref_logits = torch.cat([reference(input_ids=ids[:, s : s + n]).logits for s, n in zip(starts, lengths)], dim=1)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[0, :-1], ids[0, 1:])
    ref_loss.backward()
    batch = bt.shard_batch(
        {"input_ids": ids, "position_ids": positions, "labels": ids}, layout="doc_zigzag", model=model
    )
    out = model(**batch)
    out.loss.backward()
    bt.reduce_gradients(model)
    import burst

    cu = (0, *itertools.accumulate(lengths))
    logits = burst.unshard(out.logits, layout=burst.DocumentLayout(cu, "zigzag"))
    return {
        "logits": _rel(logits, ref_logits),
        "loss": abs(bt.reduce_loss(out.loss).item() - ref_loss.item()),
        "grads": _grads_error(model, reference),
    }


def _sliding_window(rank, world):
    """A Mistral model whose layers use a sliding window shorter than the sequence."""
    import burst
    import burst.integrations.transformers as bt
    from transformers import MistralConfig

    def config():
        return MistralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=5,
            max_position_embeddings=512,
        )

    name = bt.register("burst-window", strategy="ring", layout="striped")
    reference, model = _models(config, name)
    ids = torch.randint(0, VOCAB, (1, 8 * world), generator=torch.Generator().manual_seed(7))
    ref_out = reference(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    out = model(**bt.shard_batch({"input_ids": ids, "labels": ids}, layout="striped", model=model))
    out.loss.backward()
    bt.reduce_gradients(model)
    # The window matters: the same weights without it give other logits.
    from transformers import AutoModelForCausalLM

    no_window = copy.deepcopy(reference.config)
    no_window.sliding_window = None
    unwindowed = AutoModelForCausalLM.from_config(no_window, attn_implementation="sdpa")
    unwindowed.load_state_dict(reference.state_dict())
    with torch.no_grad():
        window_effect = _rel(unwindowed(input_ids=ids).logits, ref_out.logits)
    return {
        "logits": _rel(burst.unshard(out.logits, layout="striped"), ref_out.logits),
        "grads": _grads_error(model, reference),
        "window effect": window_effect,
    }


def _errors(rank, world):
    """What the backend cannot do raises ValueError on every rank, naming the alternative."""
    import burst.integrations.transformers as bt
    import torch.distributed as dist

    name = bt.register("burst-errors", strategy="burst")
    _, model = _models(_llama_config, name)
    ids = torch.randint(0, VOCAB, (1, 8 * world), generator=torch.Generator().manual_seed(3))
    batch = bt.shard_batch({"input_ids": ids}, model=model)
    holes = torch.ones_like(batch["input_ids"])
    if rank == 0:
        holes[0, 0] = 0
    results = {}
    cases = {
        "padding on one rank": lambda: model(**batch, attention_mask=holes),
        "padding in shard_batch": lambda: bt.shard_batch(
            {"input_ids": ids, "attention_mask": torch.zeros_like(ids)}, model=model
        ),
        # a sampler over the whole world hands each rank its own sequence: shards of two would be joined as one
        "a different batch per rank": lambda: bt.shard_batch(
            {"input_ids": ids, "labels": (ids + rank) % VOCAB}, model=model
        ),
        "output_attentions": lambda: model(**batch, output_attentions=True),
        "default positions": lambda: model(input_ids=batch["input_ids"]),
        "cached decoding": lambda: model.generate(
            batch["input_ids"], position_ids=batch["position_ids"], max_new_tokens=2, do_sample=False
        ),
    }
    # a model built on each rank without a common seed: each rank's shard would meet other weights
    _, skewed = _models(_llama_config, name)
    with torch.no_grad():
        skewed.model.layers[0].mlp.up_proj.weight.mul_(1 + 0.01 * rank)
    cases["different weights per rank"] = lambda: bt.shard_batch({"input_ids": ids}, model=skewed)
    _, last_row = _models(_llama_config, name)  # rows added at the end (resized embeddings) are sampled too
    with torch.no_grad():
        last_row.model.embed_tokens.weight[-1, -1] += 0.1 * rank
    cases["the last entry differs"] = lambda: bt.shard_batch({"input_ids": ids}, model=last_row)
    _, rope = _models(_llama_config, name)  # a rope setting one rank got: its buffer differs, no parameter does
    rope.model.rotary_emb.inv_freq.mul_(1 + 0.01 * rank)
    cases["different rotary frequencies per rank"] = lambda: bt.shard_batch({"input_ids": ids}, model=rope)

    def step_without_reduce():  # each rank's optimizer steps on its own share: the ranks' weights part
        _, alone = _models(_llama_config, name)
        sgd = torch.optim.SGD(alone.parameters(), lr=0.1)
        alone(**bt.shard_batch({"input_ids": ids, "labels": ids}, model=alone)).loss.backward()
        sgd.step()
        bt.shard_batch({"input_ids": ids, "labels": ids}, model=alone)

    cases["a step without reduce_gradients"] = step_without_reduce

    def ddp_step(reduce, order="zero first", scaled=False):  # DDP's average over the sequence's ranks: 1/G each
        reference, alone = _models(_llama_config, name)
        reference(input_ids=ids, labels=ids).loss.backward()
        ddp = torch.nn.parallel.DistributedDataParallel(alone)
        sgd = torch.optim.SGD(alone.parameters(), lr=0.1)
        alone._burst_loss_scaled = scaled  # as SequenceParallel marks the model it trains on a scaled loss
        for step in range(2):  # the second batch finds the first step taken
            if order == "zero first":
                alone.zero_grad(set_to_none=True)
            batch = bt.shard_batch({"input_ids": ids, "labels": ids}, model=ddp)
            if order == "zero after the batch":
                alone.zero_grad(set_to_none=True)
            (ddp(**batch).loss * (world if scaled else 1)).backward()
            if reduce:
                bt.reduce_gradients(ddp)  # the wrapper, seen through
            if step == 0:
                results[f"DDP grads, {order}, reduce {reduce}, scaled {scaled}"] = _grads_error(alone, reference)
            sgd.step()

    cases["a DDP step without reduce_gradients"] = lambda: ddp_step(reduce=False)
    cases["a DDP step without reduce_gradients, zero_grad after the batch"] = lambda: ddp_step(
        reduce=False, order="zero after the batch"
    )
    cases["a DDP step with reduce_gradients"] = lambda: ddp_step(reduce=True)
    cases["a DDP step on a loss scaled for DDP"] = lambda: ddp_step(reduce=False, scaled=True)
    one_rank_groups = [dist.new_group([r]) for r in range(world)]  # made on every rank, in order
    cases["reduce_gradients over another group"] = lambda: bt.reduce_gradients(model, group=one_rank_groups[rank])
    cases["inputs_embeds"] = lambda: bt.shard_batch({"inputs_embeds": torch.zeros(1, 8 * world, 4)}, model=model)
    # heads whose rows shard_batch would cut silently wrong: a pooled token, targets that are not next tokens
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    pooled = AutoModelForSequenceClassification.from_config(_llama_config(), attn_implementation=name)
    tagger = AutoModelForTokenClassification.from_config(_llama_config(), attn_implementation=name)
    cases["sequence classification"] = lambda: bt.shard_batch({"input_ids": ids}, model=pooled)
    cases["token classification labels"] = lambda: bt.shard_batch({"input_ids": ids, "labels": ids % 2}, model=tagger)
    cases["logits_to_keep"] = lambda: bt.shard_batch({"input_ids": ids, "logits_to_keep": 1}, model=model)
    # given to the model's call: each rank got its own shard's last logits, silently (a helper's probe)
    cases["logits_to_keep to the model"] = lambda: model(**batch, logits_to_keep=1)
    cases["logits_to_keep positions to the model"] = lambda: model(**batch, logits_to_keep=torch.tensor([0, 3]))
    # positions at an offset passed shard_batch, and the forward's refusal advised shard_batch
    offset = torch.arange(ids.shape[1])[None] + 7
    cases["positions at an offset"] = lambda: bt.shard_batch({"input_ids": ids, "position_ids": offset}, model=model)
    cases["positions at an offset on rank 1"] = lambda: bt.shard_batch(
        {"input_ids": ids, "position_ids": offset - 7 * (1 - rank)}, model=model
    )
    cases["ignore_index to the model"] = lambda: model(**batch, ignore_index=-1)
    # a window of no key would have become burst's (-1, 0): no window at all
    _, windowless = _models(lambda: tiny_decoder_config("MistralConfig", VOCAB, sliding_window=0), name)
    cases["sliding_window=0"] = lambda: windowless(**batch)
    # beyond text: images' features go to their tokens (split across ranks) and their tokens attend both ways
    from burst.bench.hf_zoo import causal_lm, tiny_config
    from transformers import GemmaConfig, GemmaForCausalLM

    # Bamba's z-loss: a mean over the tokens the model runs, each rank's own on a shard
    z_config = tiny_config("bamba")
    z_config.z_loss_coefficient = 0.1
    z_loss_model = causal_lm("bamba", z_config, attn_implementation=name)
    z_ids = torch.randint(0, z_config.vocab_size, (1, 8 * world), generator=torch.Generator().manual_seed(4))
    cases["z-loss"] = lambda: z_loss_model(
        **bt.shard_batch({"input_ids": z_ids, "labels": z_ids}, model=z_loss_model), use_cache=False
    )

    gemma3 = causal_lm("gemma3", tiny_config("gemma3"), attn_implementation=name)
    images = (ids > 0) & (torch.arange(ids.shape[1]) % 5 == 1)
    cases["pixel_values"] = lambda: bt.shard_batch(
        {"input_ids": ids, "pixel_values": torch.zeros(1, 3, 4, 4)}, model=model
    )
    cases["image token types"] = lambda: bt.shard_batch(
        {"input_ids": ids, "token_type_ids": images.long()}, model=gemma3
    )
    cases["mrope positions"] = lambda: bt.shard_batch(
        {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand(3, 1, -1)}, model=model
    )
    prefix_lm = GemmaForCausalLM(  # PaliGemma's text model: not causal by the layer, causal by the mask
        GemmaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            use_bidirectional_attention=True,
            attn_implementation=name,
        )
    )
    cases["bidirectional by the mask"] = lambda: prefix_lm(**bt.shard_batch({"input_ids": ids}, model=prefix_lm))

    def twice(zero):  # two micro-batches' backward, reduce_gradients after each: wrong unless zeroed between
        model.zero_grad(set_to_none=False)
        for _ in range(2):
            model(**bt.shard_batch({"input_ids": ids, "labels": ids}, model=model)).loss.backward()
            bt.reduce_gradients(model)
            if zero:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # in place, as a step's clipping is
                model.zero_grad(set_to_none=False)

    cases["reduce after each micro-batch"] = lambda: twice(zero=False)
    cases["reduce, zero_grad, again"] = lambda: twice(zero=True)
    # a batch's own shift_labels (a prompt left out of the loss) and token count are kept, as one process keeps them
    reference, _ = _models(_llama_config, name)
    own = ids.clone()
    own[:, : 3 * world] = -100
    expected = reference(input_ids=ids, labels=ids, shift_labels=own, num_items_in_batch=50).loss
    shard = bt.shard_batch(
        {"input_ids": ids, "labels": ids, "shift_labels": own, "num_items_in_batch": 50}, model=model
    )
    own_difference = abs(bt.reduce_loss(model(**shard).loss.detach()).item() - expected.item())
    # padding labelled with a token id of its own (ignore_index=0): the model's loss had summed those positions
    # and left them out of its count (1.78x one process's; a helper's probe)
    padded = ids.clone()
    padded[:, -2 * world :] = 0
    expected = reference(input_ids=ids, labels=padded.masked_fill(padded == 0, -100)).loss
    shard = bt.shard_batch({"input_ids": ids, "labels": padded}, model=model, ignore_index=0)
    results["ignore_index 0"] = abs(bt.reduce_loss(model(**shard).loss.detach()).item() - expected.item())
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    cases["dropout"] = lambda: model(**batch)
    results["own shift_labels and count"] = own_difference
    for case, fn in cases.items():
        model.train(case == "dropout")
        results[case] = value_error_text(fn)
    model.eval()
    results["works after"] = model(**batch).logits.shape == (1, 8, VOCAB)
    # torch.compile around DDP (torch's own order) as well as DDP around it: shard_batch finds the model in both
    wrapped = torch.compile(torch.nn.parallel.DistributedDataParallel(model))
    results["compile of DDP"] = bt.shard_batch({"input_ids": ids}, model=wrapped)["input_ids"].shape == (1, 8)
    typed = bt.shard_batch({"input_ids": ids, "token_type_ids": ids % 2}, model=model)  # per token: cut alike
    results["token_type_ids cut"] = torch.equal(typed["token_type_ids"], typed["input_ids"] % 2)
    return results


def _everything(rank, world):
    torch.set_num_threads(1)
    results = {"parity": {combo: _parity(rank, world, *combo) for combo in COMBOS}}
    if world in (2, 3):
        results["packed"] = _packed(rank, world)
        results["packed per document"] = _packed_per_document(rank, world)
        results["window"] = _sliding_window(rank, world)
    if world == 2:
        results["errors"] = _errors(rank, world)
    return results


_results = results_by_world(_everything, timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_llama_logits_grads_and_adamw_step_match_single_process(world):
    for rank, results in enumerate(_results(world)):
        for combo, errors in results["parity"].items():
            assert errors["logits"] < 1e-4 and errors["grads"] < 1e-4, (rank, combo, errors)
            assert errors["loss"] < 1e-5 and errors["params after AdamW"] < 1e-2, (rank, combo, errors)
            assert errors["pickled"] == 0, (rank, combo, errors)


@pytest.mark.parametrize("world", [2, 3])
def test_packed_documents_and_sliding_window(world):
    for rank, results in enumerate(_results(world)):
        assert results["packed"] < 1e-4, (rank, results["packed"])
        per_doc = results["packed per document"]
        assert per_doc["logits"] < 1e-4 and per_doc["grads"] < 1e-4 and per_doc["loss"] < 1e-5, (rank, per_doc)
        window = results["window"]
        assert window["logits"] < 1e-4 and window["grads"] < 1e-4 and window["window effect"] > 1e-3, (rank, window)


def test_unsupported_raises_on_every_rank():
    expected = {
        "padding on one rank": "padding",
        "padding in shard_batch": "padding",
        "output_attentions": "output_attentions",
        "default positions": "global positions",
        "cached decoding": "ShardedCache",
        "dropout": "dropout",
        "a different batch per rank": "must hold the same batch",
        "different weights per rank": "must run one model",
        "the last entry differs": "must run one model",
        "different rotary frequencies per rank": "must run one model",
        "a step without reduce_gradients": "Call bt.reduce_gradients(model) after the backward",
        "a DDP step without reduce_gradients": "leaves every gradient 1/2 of one process's",
        "a DDP step without reduce_gradients, zero_grad after the batch": "leaves every gradient 1/2 of one process's",
        "reduce_gradients over another group": "reduce_gradients(group=...) holds ranks",
        "inputs_embeds": "needs the batch's input_ids",
        "sequence classification": "pools one token of each row",
        "token classification labels": "loss is ForTokenClassification",
        "logits_to_keep": "each rank's shard",
        "logits_to_keep to the model": "logits_to_keep=1 would keep the last tokens (or the positions) of each rank's",
        "logits_to_keep positions to the model": "logits_to_keep=a tensor of 2 positions would keep",
        "positions at an offset": "shard_batch: position_ids starting at [7] are not a whole sequence's",
        "positions at an offset on rank 1": "starting at [7] are not a whole sequence's",
        "ignore_index to the model": "bt.shard_batch(batch, ignore_index=...)",
        "sliding_window=0": "passes sliding_window=0",
        "z-loss": "set z_loss_coefficient=0 across ranks",
        "pixel_values": "shard_batch got pixel_values",
        "image token types": "shard_batch got token_type_ids",
        "mrope positions": "multi-dimensional rotary positions",
        "bidirectional by the mask": "use_bidirectional_attention",
        "reduce after each micro-batch": "a backward added into gradients it had already summed",
    }
    for rank, results in enumerate(_results(2)):
        errors = results["errors"]
        for case, words in expected.items():
            assert errors[case] is not None and words in errors[case], (rank, case, errors[case])
        assert errors["reduce, zero_grad, again"] is None, errors["reduce, zero_grad, again"]
        for case in ("a DDP step with reduce_gradients", "a DDP step on a loss scaled for DDP"):
            assert errors[case] is None, (rank, case, errors[case])
        for case in ("zero first, reduce True, scaled False", "zero first, reduce False, scaled True"):
            assert errors[f"DDP grads, {case}"] < 1e-4, (rank, case, errors[f"DDP grads, {case}"])
        assert errors["own shift_labels and count"] < 1e-5, errors["own shift_labels and count"]
        assert errors["ignore_index 0"] < 1e-5, errors["ignore_index 0"]
        assert errors["works after"] and errors["token_type_ids cut"] and errors["compile of DDP"]


def test_register_refuses_what_the_layers_set_and_options_no_strategy_takes():
    """register(**options) is checked when called, not at the first forward: the layers' own keywords
    (causal, window...) and options the strategy does not take raise, naming what it takes."""
    import burst.integrations.transformers as bt

    for options, words in (
        ({"causal": True}, "causal: set by each layer"),
        ({"window": (4, 0)}, "window: set by each layer"),
        ({"scale": 0.1}, "takes no option 'scale'"),
        ({"chunk_rowz": 4}, "did you mean 'chunk_rows'"),
        ({"strategy": "auto", "chunk_rowz": 4}, "no strategy takes"),
        ({"strategy": "auto", "chunk_rows": -1}, "chunk_rows must be a non-negative int"),  # a value, for auto too
    ):
        with pytest.raises(ValueError, match=words):
            bt.register("burst_options", **options)
    assert bt.register("burst_options", chunk_rows=4, topology=None) == "burst_options"
    for own in ("sdpa", "eager", "flex_attention", "sdpa_paged"):  # would replace transformers' own, never undone
        with pytest.raises(ValueError, match="one of transformers' own attention implementations"):
            bt.register(own)


def _torchrun_losses(nproc: int, *flags: str) -> list[float]:
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "transformers_train.py"
    stdout = run_torchrun(script, nproc, "--steps", "2", "--seq-len", "96", *flags)
    return [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("step")]


def test_torchrun_example_trains_like_one_process():
    """The README's recipe as a user runs it: torchrun, 3 ranks vs 1, two AdamW steps."""
    one, three = _torchrun_losses(1), _torchrun_losses(3)
    assert len(one) == len(three) == 2
    assert max(abs(a - b) for a, b in zip(one, three)) < 1e-5, (one, three)


def test_torchrun_long_context_recipe_trains_like_one_process():
    """bf16 autocast + gradient checkpointing + FSDP2 (bt.fully_shard) under torchrun, 2 ranks vs 1.
    (Per-step gradients of these jobs are compared exactly in tests/test_transformers_jobs.py.)"""
    flags = ("--bf16", "--checkpointing", "--fsdp")
    one, two = _torchrun_losses(1, *flags), _torchrun_losses(2, *flags)
    assert len(one) == len(two) == 2
    assert max(abs(a - b) for a, b in zip(one, two)) < 2e-2, (one, two)


def test_tested_range_is_the_hf_extras():
    """The range the error messages name is the `hf` extra's, whose ends scripts/test.sh tests."""
    import pathlib
    import re

    from burst.integrations.transformers import TESTED_TRANSFORMERS

    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'"transformers(.*?)"', pyproject).group(1) == TESTED_TRANSFORMERS


def test_a_release_outside_the_tested_range_warns_once(monkeypatch):
    import warnings

    import burst.integrations.transformers as bt
    import transformers
    from burst.integrations.transformers.backend import attention

    attention._warn_if_untested.cache_clear()
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.warns(UserWarning, match="tested on transformers>=.*not on 5.17.0"):
        bt.register("burst_untested")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bt.register("burst_untested")  # once a process
    attention._warn_if_untested.cache_clear()
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bt.register("burst_untested")  # this release is in the range


def test_shard_batch_without_the_model_is_a_type_error_naming_why():
    """The README's line without model= (each rank would run Mamba or GPT-1 on its shard alone)."""
    import burst.integrations.transformers as bt

    ids = torch.zeros(1, 8, dtype=torch.long)
    for call in (
        lambda: bt.shard_batch({"input_ids": ids}, layout="zigzag"),
        lambda: bt.shard_batch({"input_ids": ids}, model=None),
    ):
        with pytest.raises(TypeError, match="model=model.*never calls attention"):
            call()


def test_packed_rows_with_a_cache_on_warn_once_that_transformers_attends_across_them():
    """transformers' eager / sdpa attention separates packed documents only without a cache; burst always
    does. shard_batch says so once, when a batch is packed and the model would build a cache."""
    import warnings

    import burst.integrations.transformers as bt
    from burst.integrations.transformers.backend import batches

    batches._packed_with_a_cache_warning.cache_clear()
    _, model = _models(_llama_config, bt.register("burst-packed-cache"))
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    packed = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bt.shard_batch({"input_ids": ids, "position_ids": packed, "use_cache": False}, model=model)
        bt.shard_batch({"input_ids": ids}, model=model)  # one document
        checkpointing = (
            "activation_checkpointing"
            if hasattr(model, "activation_checkpointing_enable")
            else "gradient_checkpointing"
        )
        getattr(model, f"{checkpointing}_enable")()
        model.train()  # transformers turns the cache off there itself
        bt.shard_batch({"input_ids": ids, "position_ids": packed}, model=model)
        getattr(model, f"{checkpointing}_disable")()
    with pytest.warns(UserWarning, match="use_cache=False"):
        bt.shard_batch({"input_ids": ids, "position_ids": packed}, model=model)


def test_packed_rows_on_a_family_whose_masks_ignore_positions_warn_and_stay_each_document_alone():
    """GPT-OSS builds its masks without position_ids, so its eager attention runs packed documents into
    each other with or without a cache. burst keeps them apart (each document as if run alone: checked
    here) and shard_batch says the two differ; Llama's masks read position_ids (no such warning)."""

    import burst.integrations.transformers as bt
    from burst.bench.hf_zoo_configs import tiny_config
    from burst.integrations.transformers.backend import batches, documents
    from transformers import AutoModelForCausalLM

    assert documents.masks_read_positions(_models(_llama_config, "sdpa")[0])
    batches._packed_across_documents_warning.cache_clear()

    def config():  # one each: from_config sets the attention implementation on the config it is given
        c = tiny_config("gpt_oss")
        c.initializer_range = 0.3  # weights large enough that a document attending to another shows
        return c

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config(), attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_config(config(), attn_implementation=bt.register("burst-packed-gpt-oss")).eval()
    model.load_state_dict(reference.state_dict())
    assert not documents.masks_read_positions(model)
    lengths = (5, 7)
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    packed = torch.cat([torch.arange(n) for n in lengths])[None]
    with pytest.warns(UserWarning, match="builds its masks without position_ids"):
        batch = bt.shard_batch({"input_ids": ids, "position_ids": packed, "use_cache": False}, model=model)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "shift_labels"}).logits
        alone = torch.cat([reference(input_ids=doc, use_cache=False).logits for doc in ids.split(lengths, dim=1)], 1)
        across = reference(input_ids=ids, position_ids=packed, use_cache=False).logits
    assert _rel(logits, alone) < 1e-5, _rel(logits, alone)
    assert _rel(across, alone) > 1e-3  # what the warning is about: eager runs the second document into the first


def test_packed_rows_through_recurrent_layers_warn_once_that_their_state_runs_across():
    """A hybrid's recurrent layers carry their state from one packed document into the next, as transformers' own
    code does without cu_seqlens: burst matched one process, but said nothing where attention keeps the documents
    apart and the scans do not (a helper's probe: Qwen3-Next, 3.4e-3 from each document run alone)."""
    import burst.integrations.transformers as bt
    from burst.bench.hf_zoo_configs import tiny_config
    from burst.integrations.transformers.backend import batches
    from transformers import AutoModelForCausalLM

    batches._packed_through_recurrent_layers_warning.cache_clear()
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"), attn_implementation=bt.register("burst-h"))
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    packed = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with pytest.warns(UserWarning, match="recurrent and convolutional layers carry their state"):
        bt.shard_batch({"input_ids": ids, "position_ids": packed, "use_cache": False}, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one document per row: nothing to say
        bt.shard_batch({"input_ids": ids, "use_cache": False}, model=model)


def test_peft_prompt_learning_is_refused_by_name():
    """PEFT's prompt, prefix and p-tuning put virtual tokens before each rank's shard (a helper found them refused
    only by messages that blamed the user's sharding); adapters on the weights are not refused."""
    from types import SimpleNamespace

    from burst.integrations.transformers.backend.batches import check_head

    prompt = SimpleNamespace(active_peft_config=SimpleNamespace(is_prompt_learning=True, peft_type="PROMPT_TUNING"))
    with pytest.raises(ValueError, match="PROMPT_TUNING puts virtual tokens before every rank's shard"):
        check_head(prompt, {"input_ids": None})
    lora = SimpleNamespace(active_peft_config=SimpleNamespace(is_prompt_learning=False, peft_type="LORA"))
    check_head(lora, {"input_ids": None, "labels": None})


def test_shard_batch_prepares_the_model_inside_torch_compile_s_wrapper():
    """shard_batch(model=torch.compile(model)) was refused for the families whose mixers burst finds by their
    modeling module's functions (Mamba, Qwen3-Next, Bamba, RWKV: "OptimizedModule: neither its ... functions"):
    the wrapper is seen through, as DDP's is."""
    from burst.integrations.transformers.backend.registry import unwrap_model

    model = torch.nn.Linear(2, 2)
    assert unwrap_model(torch.compile(model, backend="eager")) == (model, None)
    assert unwrap_model(model) == (model, None)
