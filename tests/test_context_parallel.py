"""burst.context_parallel on models that call scaled_dot_product_attention, against the one-process model.

Three models: (a) torch's nn.TransformerEncoder with a position buffer, full and causal (the is_causal
hint path through nn.MultiheadAttention, an SDPA call nested in another overridable function); (b) a
small RoPE decoder of our own calling F.scaled_dot_product_attention(enable_gqa=True) with a cos/sin
buffer; (c) a transformers Llama on its own "sdpa" attention (not our code), position ids as a buffer.
Each at 2 ranks over contiguous, zigzag and striped, and at 3 ranks over one of them (every layout by
some model at 3, so the odd world meets each layout): the output (gathered) and every parameter
gradient (summed over ranks) equal the one-process model's. One world per size, the cases looped in it.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from cases import rel_err as _rel
from world import results_by_world

LAYOUTS = ("contiguous", "zigzag", "striped")
VOCAB, DIM = 32, 32
N_PER_RANK = 8


class _Encoder(nn.Module):
    """Embedding + a learned position table (a buffer of the whole sequence) + torch's encoder."""

    def __init__(self, seq_len: int, causal: bool):
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(VOCAB, DIM)
        self.register_buffer("positions", torch.randn(seq_len, DIM))
        layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.positions
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1]) if self.causal else None
        return self.head(self.encoder(x, mask=mask, is_causal=self.causal))


class _RopeDecoder(nn.Module):
    """Two causal attention blocks with rotary positions from a (seq_len, head_dim) cos/sin buffer; GQA."""

    def __init__(self, seq_len: int, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, DIM // heads
        self.embed = nn.Embedding(VOCAB, DIM)
        half = self.head_dim // 2
        angles = torch.arange(seq_len)[:, None] * (10000.0 ** (-torch.arange(half) / half))[None]
        self.register_buffer("cos", angles.cos().repeat(1, 2))
        self.register_buffer("sin", angles.sin().repeat(1, 2))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"q": nn.Linear(DIM, DIM), "kv": nn.Linear(DIM, 2 * kv_heads * self.head_dim), "o": nn.Linear(DIM, DIM)}
            )
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def _rope(self, x):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin

    def forward(self, ids):
        x = self.embed(ids)
        b, s, _ = x.shape
        for block in self.blocks:
            q = block["q"](x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
            k, v = block["kv"](x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            o = F.scaled_dot_product_attention(self._rope(q), self._rope(k), v, is_causal=True, enable_gqa=True)
            x = x + block["o"](o.transpose(1, 2).reshape(b, s, DIM))
        return self.head(x)


class _HFLlama(nn.Module):
    """transformers' Llama on attn_implementation="sdpa" (its own SDPA call); position ids are a buffer."""

    def __init__(self, seq_len: int):
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=DIM,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        self.register_buffer("position_ids", torch.arange(seq_len)[None])

    def forward(self, ids):
        return self.model(input_ids=ids, position_ids=self.position_ids).logits


def _models(seq_len):
    models = {
        "encoder full": lambda: _Encoder(seq_len, causal=False),
        "encoder causal": lambda: _Encoder(seq_len, causal=True),
        "rope decoder gqa": lambda: _RopeDecoder(seq_len),
    }
    try:
        import transformers  # noqa: F401

        models["transformers llama (sdpa)"] = lambda: _HFLlama(seq_len)
    except ImportError:
        if os.environ.get("CI"):
            raise
    return models


def _buffers(model):
    """The model's whole-sequence buffers and their sequence dims."""
    names = {"positions": 0, "cos": 0, "sin": 0, "position_ids": 1}
    found = [(buf, names[name]) for name, buf in model.named_buffers() if name.split(".")[-1] in names]
    return [b for b, _ in found], [d for _, d in found]


def _one_case(build, layout, world, **cp_options):
    import burst

    seq_len = N_PER_RANK * world
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=g)
    upstream = torch.randn(2, seq_len, VOCAB, generator=g)
    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    model = build()
    ref_out = reference(ids)
    (ref_out * upstream).sum().backward()

    tokens = ids.clone()
    buffers, dims = _buffers(model)
    whole = [b.clone() for b in buffers]
    mesh = cp_options.pop("mesh", None)  # first and positional, as torch's context_parallel takes it
    with burst.context_parallel(
        mesh,
        buffers=[tokens, *buffers],
        buffer_seq_dims=[1, *dims],
        no_restore_buffers={tokens},
        layout=layout,
        **cp_options,
    ):
        out = model(tokens)
        (out * burst.shard(upstream, layout=layout)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    named = dict(reference.named_parameters())
    return {
        "out": _rel(burst.unshard(out.detach(), layout=layout), ref_out.detach()),
        "grads": max(_rel(p.grad, named[n].grad) for n, p in model.named_parameters()),
        "buffers restored": all(torch.equal(b, w) for b, w in zip(buffers, whole)),
        "tokens left sharded": tokens.shape[1] == N_PER_RANK,
        "sdpa restored": F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention,
    }


def _errors(rank, world):
    """What cannot be honoured raises ValueError on every rank (some only on rank 0's input)."""
    import burst

    x = torch.randn(1, 2, N_PER_RANK * world, 8)
    q, k, v = (x.clone() for _ in range(3))
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    tokens = torch.randn(1, N_PER_RANK * world, 8)
    cases = {
        "attn_mask": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.ones(N_PER_RANK, N_PER_RANK, dtype=torch.bool)
        ),
        "dropout on rank 0": lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if rank == 0 else 0.0),
        "length": lambda: F.scaled_dot_product_attention(q[..., :2, :], k[..., :2, :], v[..., :2, :]),
        "need_weights": lambda: mha(tokens, tokens, tokens),
        "gqa without enable_gqa": lambda: F.scaled_dot_product_attention(q, k[:, :1], v[:, :1]),
    }
    # BART's learned positions: numbered from the shard's own length, so rank 1 embeds rank 0's positions.
    table = nn.Embedding(N_PER_RANK * world + 2, 8)
    shard_counted = lambda: F.scaled_dot_product_attention(q + table(torch.arange(N_PER_RANK) + 2)[None, None], k, v)
    held = lambda: F.scaled_dot_product_attention(q + table(positions + 2)[None, None], k, v)
    # GPT-2-style code indexing the table's rows itself
    rows_counted = lambda: F.scaled_dot_product_attention(q + table.weight[torch.arange(N_PER_RANK), :], k, v)
    rows_held = lambda: F.scaled_dot_product_attention(q + table.weight[positions], k, v)
    layouts = {name: "zigzag" for name in cases}
    for layout in ("zigzag", "contiguous"):
        for name, fn in (
            (f"positions from the shard, {layout}", shard_counted),
            (f"positions held, {layout}", held),
            (f"rows from the shard, {layout}", rows_counted),
            (f"rows held, {layout}", rows_held),
        ):
            cases[name], layouts[name] = fn, layout
    results = {}
    for name, fn in cases.items():
        q, k, v = (x.clone() for _ in range(3))
        tokens = torch.randn(1, N_PER_RANK * world, 8)
        positions = torch.arange(N_PER_RANK * world)
        try:
            with burst.context_parallel(
                buffers=[q, k, v, tokens, positions], buffer_seq_dims=[2, 2, 2, 1, 0], layout=layouts[name]
            ):
                fn()
            results[name] = None
        except ValueError as err:
            results[name] = str(err)
    results["sdpa restored"] = F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    results["buffers restored"] = q.shape[2] == N_PER_RANK * world
    whole = [torch.randn(1, N_PER_RANK * world)]
    for name, buffers, dims, options in (
        ("indivisible", [torch.randn(1, 5)], [1], {}),
        ("a learned table", [nn.Parameter(torch.randn(N_PER_RANK * world, 8))], [0], {}),
        ("causal given to the context", whole, [1], dict(causal=True)),  # each SDPA call's is_causal sets it
        ("return_lse", whole, [1], dict(return_lse=True)),
        ("a misspelt option", whole, [1], dict(chunk_rowz=64)),
        ("a refused value", whole, [1], dict(chunk_rows=-1)),
    ):
        try:
            with burst.context_parallel(buffers=buffers, buffer_seq_dims=dims, **options):
                pass
            results[name] = None
        except ValueError as err:
            results[name] = str(err)
    whole = [torch.randn(1, N_PER_RANK * world)]
    with burst.context_parallel(buffers=whole, buffer_seq_dims=[1]):
        try:
            with burst.context_parallel(buffers=whole, buffer_seq_dims=[1]):
                pass
            results["nested"] = None
        except ValueError as err:
            results["nested"] = str(err)
        # torch's SDPA under another name (imported before the context, or torch._C's) is routed too
        q, k, v = (burst.shard(t, layout="zigzag", dim=2) for t in (x.clone(), x.clone() * 0.5, x.clone() + 1))
        q, k, v = (t.contiguous() for t in (q, k, v))
        named = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            another = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True)
        results["sdpa by another name"] = torch.equal(named, another)
        # ... and says once where it is not (a checkpoint's recomputation)
        results["another name warned"] = any("held where burst does not replace it" in str(w.message) for w in caught)
    # a route captured inside a context (the name read there and kept) is the open context's SDPA, or torch's
    with burst.context_parallel(buffers=[], buffer_seq_dims=[]):
        captured = F.scaled_dot_product_attention
    results["captured route outside"] = torch.equal(
        captured(q, k, v, is_causal=True), torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    with burst.context_parallel(buffers=[], buffer_seq_dims=[], layout="contiguous"):
        results["captured route in another context"] = torch.equal(
            captured(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ) and not torch.equal(captured(q, k, v, is_causal=True), named)  # contiguous, not the zigzag context's
    try:  # the buffers where torch's signature has the mesh
        with burst.context_parallel([torch.randn(1, N_PER_RANK * world)], buffer_seq_dims=[1]):
            pass
        results["buffers first"] = None
    except TypeError as err:
        results["buffers first"] = str(err)
    tokens = torch.arange(N_PER_RANK * world)[None]
    labels = tokens  # one tensor under two names, listed twice: cut once
    with burst.context_parallel(buffers=[tokens, labels], buffer_seq_dims=[1, 1]):
        results["listed twice, cut once"] = labels.shape[1] == N_PER_RANK
    results.update(_buffer_bookkeeping(rank, world))
    return results


def _buffer_bookkeeping(rank, world):
    """torch's None defaults taken; a seq dim that differs across ranks refused before any buffer is cut (the
    first had stayed cut); no_restore_buffers outside buffers refused; a reentrant checkpoint's backward after the
    context refused (it recomputed with torch's SDPA on the rank's tokens alone: wrong gradients, silently)."""
    import burst
    from torch.utils.checkpoint import checkpoint

    results = {}
    x = torch.randn(1, 2, N_PER_RANK * world, 8)
    with burst.context_parallel(buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        results["torch's None defaults"] = True
    tokens, table = torch.arange(N_PER_RANK * world)[None], torch.randn(N_PER_RANK * world, N_PER_RANK * world)
    for name, options in (
        ("a seq dim per rank", dict(buffers=[tokens, table], buffer_seq_dims=[1, rank % 2])),
        ("no_restore_buffers outside buffers", dict(buffers=[tokens], buffer_seq_dims=[1], no_restore_buffers={x})),
    ):
        try:
            with burst.context_parallel(**options):
                pass
            results[name] = None
        except ValueError as err:
            results[name] = str(err)
    results["nothing cut after a refusal"] = tokens.shape[1] == table.shape[0] == N_PER_RANK * world
    lin = nn.Linear(8, 8)

    def block(h):
        return F.scaled_dot_product_attention(lin(h), h, h, is_causal=True)

    for where in ("inside", "after", "never (a logged probe)"):
        h = x.clone().requires_grad_()
        try:
            with burst.context_parallel(buffers=[x], buffer_seq_dims=[2]):
                loss = checkpoint(block, h[..., :N_PER_RANK, :], use_reentrant=True).square().sum()
                if where == "inside":
                    loss.backward()
            if where == "after":
                loss.backward()
            results[f"reentrant checkpoint, backward {where}"] = None
        except RuntimeError as err:
            results[f"reentrant checkpoint, backward {where}"] = str(err)
    try:
        with burst.context_parallel(
            buffers=[torch.randn(1, N_PER_RANK * world)], buffer_seq_dims=[1], no_restore_buffers=x
        ):
            pass
        results["one tensor as no_restore_buffers"] = None
    except TypeError as err:
        results["one tensor as no_restore_buffers"] = str(err)
    return results


THREE_RANK_LAYOUT = {  # at 3 ranks, each model in one layout
    "encoder full": "striped",
    "encoder causal": "zigzag",
    "rope decoder gqa": "contiguous",
    "transformers llama (sdpa)": "zigzag",
}


def _layouts(world, name):
    return LAYOUTS if world == 2 else (THREE_RANK_LAYOUT[name],)


def _everything(rank, world):
    torch.set_num_threads(1)
    results = {
        (name, layout): _one_case(build, layout, world)
        for name, build in _models(N_PER_RANK * world).items()
        for layout in _layouts(world, name)
    }
    if world == 2:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        for strategy in ("ring", "ulysses", "allgather"):  # any strategy; a DeviceMesh as torch's API takes it
            results[("rope decoder gqa", f"zigzag {strategy} mesh")] = _one_case(
                _models(N_PER_RANK * world)["rope decoder gqa"], "zigzag", world, mesh=mesh, strategy=strategy
            )
        results["errors"] = _errors(rank, world)
    return results


_results = results_by_world(_everything, timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_models_calling_sdpa_train_like_one_process(world):
    for rank, results in enumerate(_results(world)):
        cases = {k: v for k, v in results.items() if k != "errors"}
        assert {layout for _, layout in cases} >= set(LAYOUTS)
        assert len(cases) >= (9 if world == 2 else 3)
        for case, r in cases.items():
            assert r["out"] < 1e-5 and r["grads"] < 1e-4, (rank, case, r)
            assert r["buffers restored"] and r["tokens left sharded"] and r["sdpa restored"], (rank, case, r)


def test_what_cannot_be_honoured_raises_on_every_rank():
    expected = {
        "attn_mask": "attn_mask",
        "dropout on rank 0": "dropout",
        "length": "tokens",
        "need_weights": "need_weights",
        "gqa without enable_gqa": "enable_gqa",
        "indivisible": "divisible",
        "a learned table": "requires grad",
        "causal given to the context": "set by each scaled_dot_product_attention call",
        "return_lse": "set by each scaled_dot_product_attention call",
        "a misspelt option": "did you mean 'chunk_rows'",
        "a refused value": "chunk_rows must be a non-negative int",
        "positions from the shard, zigzag": "its own length",
        "positions from the shard, contiguous": "its own length",
        "rows from the shard, zigzag": "its own length",
        "rows from the shard, contiguous": "its own length",
    }
    for rank, results in enumerate(_results(2)):
        errors = results["errors"]
        for case, words in expected.items():
            assert errors[case] is not None and words in errors[case], (rank, case, errors[case])
        for case in ("positions held", "rows held"):  # the rank's own positions looked up: no refusal
            for layout in ("zigzag", "contiguous"):
                assert errors[f"{case}, {layout}"] is None, (rank, case, layout, errors[f"{case}, {layout}"])
        assert errors["sdpa restored"] and errors["buffers restored"] and errors["listed twice, cut once"]
        assert errors["nested"] is not None and "already open" in errors["nested"], errors["nested"]
        assert errors["buffers first"] is not None and "buffers=[...]" in errors["buffers first"], rank
        assert errors["sdpa by another name"] and errors["another name warned"], rank
        assert errors["captured route outside"] and errors["captured route in another context"], rank
        assert errors["torch's None defaults"] and errors["nothing cut after a refusal"], rank
        assert "buffers differs across ranks" in errors["a seq dim per rank"], errors["a seq dim per rank"]
        assert "must be a subset" in errors["no_restore_buffers outside buffers"], rank
        for where in ("inside", "never (a logged probe)"):  # nothing recomputed after the context: not refused
            assert errors[f"reentrant checkpoint, backward {where}"] is None, errors[
                f"reentrant checkpoint, backward {where}"
            ]
        assert "wrap it, no_restore_buffers=[t]" in errors["one tensor as no_restore_buffers"], rank
        after = errors["reentrant checkpoint, backward after"]
        assert after is not None and "Call loss.backward() inside the context" in after, (rank, after)


def test_an_alias_in_a_script_a_rank_starts_from_is_routed(tmp_path, monkeypatch):
    """spawn_world's ranks (multiprocessing's forkserver or spawn) run the user's script as __mp_main__ through
    runpy, whose functions keep globals no module holds: an SDPA alias there is routed too (else a checkpoint's
    recomputation attends the rank's tokens alone: gradients 0.6 off, found by a helper)."""
    import runpy
    import sys
    import types

    from burst import sdpa_names

    script = tmp_path / "user_script.py"
    script.write_text(
        "from torch.nn.functional import scaled_dot_product_attention as sdpa\n\ndef attend():\n    return sdpa\n"
    )
    main = types.ModuleType("__mp_main__")  # as multiprocessing.spawn prepares the main module of a rank
    main.__dict__.update(runpy.run_path(str(script), run_name="__mp_main__"))
    monkeypatch.setitem(sys.modules, "__mp_main__", main)

    def burst_route(*args, **kwargs):
        raise AssertionError("not called")

    with sdpa_names.routed(burst_route):
        assert main.attend() is burst_route
    assert main.attend() is sdpa_names.TORCH_SDPA
