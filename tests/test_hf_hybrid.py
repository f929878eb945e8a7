"""Hybrid models (gated delta net, Mamba / Mamba2 scans, RG-LRU, short convolutions) exact across ranks.

Each family of bt.FAMILIES that this transformers release ships, built tiny from the zoo's
config (hf_zoo.tiny_config: its recurrent and convolutional layers kept), trains one step with the
sequence split over 2 ranks in zigzag (the layout with two chunks per rank, whose states pass between
chunks of other ranks) and, for a family of each mixer, in contiguous too, and over 4 ranks (a family of
each mixer, zigzag): logits,
loss and every parameter's gradient against the same model in one process. Also the state passing
itself against a float64 scan of the whole sequence, its bytes (which must not grow with the
sequence), and what stays refused.
"""

from __future__ import annotations

import pytest
import torch

from requires import transformers_or_skip
from world import results_by_world, value_errors

transformers_or_skip()

SEQ = 64
FOUR_RANKS = ("qwen3_next", "mamba", "bamba", "lfm2", "kimi_linear", "rwkv", "minimax", "xlstm", "recurrent_gemma")
# gated delta rule, Mamba, Mamba2, short convolutions alone, Kimi delta attention, RWKV-4 (token shift + WKV),
# lightning attention, mLSTM, RG-LRU (with its convolution a module)


def _models(family, name):
    """(eager model in one process, the same weights on burst's `name`), or None when not shipped."""
    from burst.bench import hf_steps, hf_zoo

    return hf_steps.twin_models(family, name) if family in hf_zoo.families() else None


def _one_step(family, layout, group, checkpointing=False):
    """hf_steps.train_step_errors on burst's backend; None when this release does not ship the family."""
    import burst.integrations.transformers as bt
    from burst.bench import hf_steps, hf_zoo

    if family not in hf_zoo.families():
        return None
    name = bt.register(f"hybrid_{layout}", layout=layout, group=group)
    return hf_steps.train_step_errors(family, name, layout, group, seq_len=SEQ, checkpointing=checkpointing)


def _scan_against_float64(layout, group):
    """h_t = a_t h_{t-1} + u_t (diagonal decays) on each rank's chunks with state_passing, against a
    float64 scan of the whole sequence: states (and the last, on every rank) and the gradients of a loss
    through them."""
    import torch.distributed as dist
    from burst import layout as layout_mod
    from burst.state_passing import scan_states

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    length, width = 48, 5
    gen = torch.Generator().manual_seed(7)
    decay = torch.rand(length, width, generator=gen, dtype=torch.float64) * 0.5 + 0.5
    inputs = torch.randn(length, width, generator=gen, dtype=torch.float64)
    weights = torch.randn(length, width, generator=gen, dtype=torch.float64)

    def scan(a, u, start):
        states, h = [], start
        for t in range(a.shape[0]):
            h = a[t] * h + u[t]
            states.append(h)
        return torch.stack(states)

    full_u = inputs.clone().requires_grad_()
    expected = scan(decay, full_u, torch.zeros(width, dtype=torch.float64))
    (expected * weights).sum().backward()

    index = layout_mod.shard_indices(layout, rank, world, length)
    local_u = inputs[index].float().requires_grad_()
    local_a = decay[index].float()
    chunks = layout_mod.segments(layout, rank, world, length // world)
    zero = torch.zeros(1, width)
    finals = [scan(local_a[s.rows], local_u[s.rows], zero)[-1] for s in chunks]
    transitions = [local_a[s.rows].prod(0, keepdim=True) for s in chunks]
    starts, last = scan_states(finals, transitions, torch.mul, layout, group, length // world)
    states = torch.cat([scan(local_a[s.rows], local_u[s.rows], h)[:, 0] for s, h in zip(chunks, starts)])
    (states * weights[index].float()).sum().backward()
    return (
        max((states.double() - expected[index]).abs().max().item(), (last.double() - expected[-1]).abs().max().item()),
        (local_u.grad.double() - full_u.grad[index]).abs().max().item(),
    )


def _state_bytes(group):
    """Bytes this rank sends for the mixers' state exchange in one forward + backward of qwen3_next,
    by sequence length: {length: {phase: bytes}}."""
    import burst
    import burst.integrations.transformers as bt

    out = {}
    for length in (SEQ, 4 * SEQ):
        _, model = _models("qwen3_next", bt.register("hybrid_bytes", layout="zigzag", group=group))
        ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(1))
        batch = bt.shard_batch({"input_ids": ids, "labels": ids}, group=group, layout="zigzag", model=model)
        with burst.CommStats() as stats:
            model(**batch, use_cache=False).loss.backward()
        out[length] = {phase: stats.sent(phase) for phase in ("gated_delta_rule_state", "conv_halo")}
    return out


def _refusals(group):
    """What a sharded hybrid model must refuse, each on every rank: {case: error text or None}."""
    import burst.integrations.transformers as bt
    from burst import layout as layout_mod
    from burst.bench import hf_zoo
    from burst.integrations.transformers.backend.features import prepare_features

    out = {}
    _, model = _models("qwen3_next", bt.register("hybrid_refusals", layout="zigzag", group=group))
    ids = torch.randint(3, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    fresh = _models("qwen3_next", "hybrid_refusals")[1]  # shard_mixers never called on it
    cases = {
        "striped": lambda: bt.shard_mixers(model, group, "striped"),
        # sharded by hand (burst.shard), past shard_batch's model check: the attention function refuses it
        "not hooked": lambda: fresh(
            input_ids=layout_mod.shard(ids, group=group, layout="zigzag", dim=1),
            position_ids=layout_mod.shard(torch.arange(SEQ)[None], group=group, layout="zigzag", dim=1),
            use_cache=False,
        ),
        "cache": lambda: model(
            **bt.shard_batch({"input_ids": ids}, group=group, layout="zigzag", model=model), use_cache=True
        ),
    }
    if "lfm2" in hf_zoo.families():  # a family burst does not know: played by lfm2 taken off the list
        from unittest import mock

        from burst.integrations.transformers.layers import mixers

        unsupported = _models("lfm2", "hybrid_refusals")[1]

        def unknown_family():
            with mock.patch.dict(mixers.FAMILIES):
                del mixers.FAMILIES["lfm2"]
                unsupported(
                    **bt.shard_batch({"input_ids": ids}, group=group, layout="zigzag", model=unsupported),
                    use_cache=False,
                )

        cases["unsupported family"] = unknown_family
    if "rwkv" in hf_zoo.families():  # its LM head passes no cache down: no sharded decoding
        rwkv = _models("rwkv", "hybrid_refusals")[1]

        def decoding():  # prepared as shard_batch prepares it
            prepare_features(rwkv, group, "zigzag")
            return rwkv.generate(ids, max_new_tokens=2, **bt.sharded_cache(rwkv))

        cases["decoding"] = decoding
    out.update(value_errors(cases))
    return out


GENERATE_FOUR_RANKS = (
    *("qwen3_next", "kimi_linear", "mamba", "bamba", "nemotron_h", "lfm2", "minimax", "zaya", "recurrent_gemma"),
)
# gated delta rule, Kimi delta attention, Mamba, Mamba2, Mamba2 with its steps clamped above 0, convolutions
# alone, lightning attention (its state in the family's own cache class), ZAYA's CCA (q/k convolved, v delayed),
# RG-LRU and its temporal convolution (their states on the modules)


def _generation(family, layout, group, length):
    """generate() on a ShardedCache (a prompt of `length` tokens, padded by the layout) against the eager
    model's own generate() in one process, and the recurrent layers' states the cache keeps after the
    prompt against those of the eager model's own cache: {tokens, logits, states, layers}; None when not
    shipped or refused."""
    import inspect

    import burst.integrations.transformers as bt
    import transformers
    from burst.bench import hf_zoo
    from burst.bench import hf_zoo_generate as zoo
    from burst.integrations.transformers import decoding
    from burst.integrations.transformers.layers import mixers
    from burst.kernels.reference import relative_error

    if family not in hf_zoo.families() or family not in mixers.GENERATE:
        return None
    ids = zoo.prompt(length)
    name = bt.register(f"hybrid_generate_{layout}", layout=layout, group=group)
    try:  # the eager model's own generate() and cache (Granite-MoE-hybrid's tiny one cannot: the zoo's skip)
        (ref_tokens, ref_logits), model, eager = zoo.build(family, name, ids, new=4)
        own = decoding.own_cache_class(eager)  # MiniMax's decoder takes its own class only
        reference = own() if own is not None else transformers.DynamicCache(config=eager.config)
        takes = inspect.signature(eager.forward).parameters  # Mamba's LM: cache_params on 5.23
        keyword = next(k for k in ("cache", "cache_params", "past_key_values") if k in takes)
        with torch.no_grad():
            eager(input_ids=ids, use_cache=True, **{keyword: reference})
    except ValueError as err:
        if "get_seq_length" in str(err):
            return None
        raise
    with torch.no_grad():
        tokens, logits = zoo.generate(model, ids, bt.ShardedCache(model), new=4)
        cache = bt.ShardedCache(model)
        zoo.generate(model, ids, cache, new=1)  # the prefill alone: the states after the prompt
    pairs = [  # (burst's, the eager cache's) conv, scan and lightning-attention states, layer by layer
        pair
        for layer in sorted(cache._recurrent)
        for pair in (
            (cache.get_conv_state(layer), reference.get_conv_state(layer)),
            (cache.get_recurrent_state(layer), reference.get_recurrent_state(layer)),
        )
    ] + [(cache.get_linear_cache(layer), reference.get_linear_cache(layer)) for layer in sorted(cache._linear)]
    blocks = [  # RecurrentGemma keeps its states on its recurrent blocks
        (ours, theirs) for ours, theirs in zip(model.modules(), eager.modules()) if hasattr(ours, "conv1d_state")
    ]
    pairs += [(a.conv1d_state, b.conv1d_state) for a, b in blocks]
    pairs += [(a.rg_lru.recurrent_states, b.rg_lru.recurrent_states) for a, b in blocks]
    states = [relative_error(got, want.double()) for got, want in pairs if want is not None]
    return {
        "tokens": torch.equal(tokens, ref_tokens),
        "logits": relative_error(logits, ref_logits.double()),
        "states": max(states),
        "layers": len(cache._recurrent) + len(cache._linear) + len(blocks),
    }


def _no_mixer_layers():
    """(hooked mixers, prepared) of MiniMax with full attention only: (0, True) (it had raised that this
    transformers release arranges the family differently); None when not shipped."""
    from transformers import AutoModelForCausalLM

    import burst.integrations.transformers as bt
    from burst.bench import hf_zoo
    from burst.bench.hf_zoo_configs import tiny_config
    from burst.integrations.transformers.layers import mixers

    if "minimax" not in hf_zoo.families():
        return None
    config = tiny_config("minimax")
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(config, attn_implementation=bt.register("hybrid_none", layout="zigzag"))
    return bt.shard_mixers(model, None, "zigzag"), mixers.prepared(model.config)


def _fully_sharded_hybrid():
    """bt.fully_shard before the first shard_batch (examples/transformers_train.py --fsdp's order): it refused a
    hybrid, whose recurrent layers shard_batch had not prepared yet; fully_shard prepares them itself now. The
    loss and every gradient (FSDP's shards gathered) against the eager twin in this process (hf_steps' measure)."""
    import burst.integrations.transformers as bt
    from burst.bench import hf_steps

    twins = _models("qwen3_next", bt.register("hybrid_fsdp", layout="zigzag"))
    if twins is None:
        return None
    reference, model = twins
    bt.fully_shard(model)
    ids = torch.randint(3, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(5))
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    loss = model(
        **bt.shard_batch({"input_ids": ids, "labels": ids}, layout="zigzag", model=model), use_cache=False
    ).loss
    loss.backward()
    bt.reduce_gradients(model)
    pairs = [
        (p.grad.full_tensor(), r.grad) for p, r in zip(model.parameters(), reference.parameters()) if r.grad is not None
    ]
    loss_error = abs(float(bt.reduce_loss(loss)) - float(expected))
    return {"loss": loss_error, "gradients": hf_steps.gradient_error(pairs), "count": len(pairs)}


def _world_cases(rank, world):
    import warnings

    import torch.distributed as dist
    import transformers
    from burst.integrations.transformers.layers import mixers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    families = sorted(mixers.FAMILIES) if world == 2 else FOUR_RANKS
    contiguous = FOUR_RANKS if world == 2 else ()  # a family of each mixer
    out = {
        "steps": {
            **{(f, "zigzag"): _one_step(f, "zigzag", None) for f in families},
            **{(f, "contiguous"): _one_step(f, "contiguous", None) for f in contiguous},
        },
        "scan": {layout: _scan_against_float64(layout, None) for layout in ("contiguous", "zigzag")},
    }
    out["steps"][("qwen3_next", "zigzag, checkpointing")] = _one_step("qwen3_next", "zigzag", None, True)
    # generate(): every family at 2 ranks in zigzag (prompts of 13: padded to 16), a family of each mixer in
    # contiguous and on one rank (a group of its own: the padded prompt's scans run whole, quiet past its end);
    # at 4 ranks prompts of 3 (each rank a token or padding, fewer than the convolutions' width) and of 29
    if world == 2:
        cases = [(f, "zigzag", 13, None) for f in families] + [(f, "contiguous", 13, None) for f in GENERATE_FOUR_RANKS]
        cases += [(f, "contiguous", 2, None) for f in GENERATE_FOUR_RANKS]  # shards of 2 (not of 1: decode-like)
        alone = [dist.new_group([r]) for r in range(world)][rank]
        cases += [(f, "zigzag", 13, alone) for f in GENERATE_FOUR_RANKS]
    else:
        cases = [(f, "zigzag", n, None) for f in GENERATE_FOUR_RANKS for n in (3, 29)]
    out["generate"] = {
        (f, layout + (", one rank" if group else ""), n): _generation(f, layout, group, n)
        for f, layout, n, group in cases
    }
    if world == 2:  # a family burst splits, configured without a layer outside attention: nothing to hook
        out["no mixer layers"] = _no_mixer_layers()
    if world == 2:
        out["fully sharded"] = _fully_sharded_hybrid()
        out["bytes"] = _state_bytes(None)
        out["refusals"] = _refusals(None)
    return out


results = results_by_world(_world_cases)


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_families_train_exactly_across_ranks(world):
    steps = results(world)[0]["steps"]
    shipped = {key: got for key, got in steps.items() if got is not None}
    assert len(shipped) >= (30 if world == 2 else 8), sorted(steps)  # this release ships most of them
    assert {layout for _, layout in shipped} >= ({"contiguous", "zigzag"} if world == 2 else {"zigzag"}), sorted(steps)
    for (family, layout), got in shipped.items():
        assert got["logits"] < 2e-5 and got["loss"] < 2e-5, (family, layout, got)
        assert got["gradients"] < 1e-4 and got["gradient_count"] > 4, (family, layout, got)


def test_a_hybrid_is_fully_sharded_before_its_first_batch():
    got = results(2)[0]["fully sharded"]
    if got is not None:
        assert got["loss"] < 2e-5 and got["gradients"] < 1e-4 and got["count"] > 4, got


@pytest.mark.parametrize("world", [2, 4])
def test_state_passing_matches_a_float64_scan(world):
    for layout, (states, gradients) in results(world)[0]["scan"].items():
        assert states < 1e-5 and gradients < 1e-5, (layout, states, gradients)


def test_state_exchange_does_not_grow_with_the_sequence():
    by_length = results(2)[0]["bytes"]
    short, long = by_length[SEQ], by_length[4 * SEQ]
    assert short["gated_delta_rule_state"] > 0 and short["conv_halo"] > 0, short
    assert long == short, by_length


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_families_generate_on_a_sharded_cache_exactly(world):
    """The prompt runs split (each scan hands the state after its last real token, the convolution the
    prompt's last inputs), each new token whole on every rank: the same tokens and logits as the eager
    model's own generate(), and the states kept after the prompt those of its own cache."""
    generated = {case: got for case, got in results(world)[0]["generate"].items() if got is not None}
    assert len(generated) >= (20 if world == 2 else 10), sorted(generated)
    for case, got in generated.items():
        assert got["tokens"] and got["logits"] < 1e-4, (case, got)
        assert got["layers"] > 0 and got["states"] < 1e-4, (case, got)


def test_a_family_configured_without_mixers_needs_no_hooks():
    got = results(2)[0]["no mixer layers"]
    assert got is None or got == (0, True), got


def test_generate_without_a_process_group():
    """One process that never made a process group (plain `python`): a world of one, no collective."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    for family in ("qwen3_next", "zaya", "recurrent_gemma", "minimax"):
        got = _generation(family, "zigzag", None, 13)
        assert got is None or (got["tokens"] and got["logits"] < 1e-4 and got["states"] < 1e-4), (family, got)


def test_what_a_hybrid_model_cannot_do_is_refused():
    refusals = results(2)[0]["refusals"]
    assert "holds one token in 2" in refusals["striped"]
    assert "shard_mixers" in refusals["not hooked"]
    assert "cache" in refusals["cache"]
    if "unsupported family" in refusals:
        assert (
            "outside attention" in refusals["unsupported family"]
            or "not among the families" in refusals["unsupported family"]
        ), refusals["unsupported family"]
    if "decoding" in refusals:  # RWKV's state is not carried
        assert "generate() on a sharded cache is refused" in (refusals["decoding"] or ""), refusals["decoding"]


def test_a_named_document_layout_reaches_the_hybrids_mixers():
    """shard_batch(layout="doc_zigzag") with packed position_ids: the documents are read before the
    recurrent layers are prepared, so a hybrid (Mamba) takes the named layout as a Transformer does (it
    had been refused, "pass burst.DocumentLayout(...)"), the same loss as that DocumentLayout given."""
    import burst
    import burst.integrations.transformers as bt
    import transformers

    config = transformers.MambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=4
    )
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.cat([torch.arange(8), torch.arange(24)])[None]}
    losses = []
    for layout in ("doc_zigzag", burst.DocumentLayout((0, 8, 32), "zigzag")):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=bt.register("doc_named"))
        losses.append(float(model(**bt.shard_batch(batch, layout=layout, model=model), use_cache=False).loss))
    assert losses[0] == losses[1], losses
