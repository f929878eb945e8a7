"""burst.attention under torch.compile: one custom op in the graph (burst/custom_op.py), no graph break.

On 2 ranks, against eager burst.attention (which tests elsewhere compare with float64 attention):
compiled with fullgraph=True (which fails on any graph break), output and gradients equal; the
same inside an activation-checkpointed block, where a graph break would make dynamo run the whole
block eagerly; with sinks, GQA, strategy options (ints, words) and head dims of stride > 1; under
bf16 autocast; one tensor as both keys and values; SDPA routed by burst.context_parallel in a
compiled checkpointed block; and a call the op's schema cannot carry (a block-sparse mask) still
right, through the eager path behind a graph break.
"""

from __future__ import annotations

import functools

import burst
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from world import results_by_world

SEQ, HEADS, KV_HEADS, DIM = 64, 4, 2, 8


def _inputs(seed: int, layout: str):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, SEQ, HEADS, DIM, generator=g)
    k, v = (torch.randn(1, SEQ, KV_HEADS, DIM, generator=g) for _ in range(2))
    weight = torch.randn(HEADS * DIM, HEADS * DIM, generator=g) / 8
    return [burst.shard(t, layout=layout) for t in (q, k, v)], weight


def _grads(fn, tensors, weight):
    tensors = [t.clone().requires_grad_() for t in tensors]
    weight = weight.clone().requires_grad_()
    out = fn(*tensors, weight)
    out.square().sum().backward()
    return [out.detach()] + [t.grad for t in tensors] + [weight.grad]


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _cases(rank, world):
    import torch._dynamo

    sinks = torch.linspace(-1.0, 1.0, HEADS)
    settings = {
        "causal zigzag": (dict(causal=True, layout="zigzag"), "zigzag"),
        "window, sinks, chunk_rows": (dict(causal=True, window=(20, 0), sinks=sinks, chunk_rows=8), "contiguous"),
        "documents (cu_seqlens ints)": (dict(causal=True, cu_seqlens=[0, 20, 48, 64]), "contiguous"),
        # float32: its dk and dv come from one accumulator, views that the op's outputs must not share
        "allgather": (dict(causal=True, strategy="allgather"), "contiguous"),
        # head dims of stride > 1 (a projection stored (b, s, d, h), transposed): the op's backward read them as is
        "strided head dims": (dict(causal=True, layout="zigzag"), "zigzag"),
        # an option of words, carried by the op: it had made fullgraph=True fail on a graph break
        "backward_side='keys'": (dict(causal=True, layout="zigzag", backward_side="keys"), "zigzag"),
    }
    results = {}
    for name, (kwargs, layout) in settings.items():
        (q, k, v), weight = _inputs(1, layout)
        if name == "strided head dims":
            q, k, v = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in (q, k, v))

        def attend(q, k, v, weight):
            out = burst.attention(q, k, v, **kwargs)
            return out.flatten(2) @ weight

        def block(q, k, v, weight):  # checkpointed: recomputed in the backward
            return checkpoint(attend, q, k, v, weight, use_reentrant=False)

        eager = _grads(attend, (q, k, v), weight)
        torch._dynamo.reset()
        breaks = torch._dynamo.explain(attend)(q, k, v, weight).graph_break_count
        compiled = _grads(torch.compile(attend, fullgraph=True), (q, k, v), weight)
        torch._dynamo.reset()
        checkpointed = _grads(torch.compile(block, fullgraph=True), (q, k, v), weight)
        results[name] = (breaks, _max_diff(compiled, eager), _max_diff(checkpointed, eager))

    # SDPA routed by burst.context_parallel, in a compiled checkpointed block (fullgraph: no break).
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, HEADS, SEQ, DIM, generator=g) for _ in range(3))
    weight = torch.randn(HEADS * DIM, HEADS * DIM, generator=g) / 8

    def sdpa_block(q, k, v, weight):
        def inner(q, k, v, weight):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2) @ weight

        return checkpoint(inner, q, k, v, weight, use_reentrant=False)

    shards = []
    with burst.context_parallel(buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        eager = _grads(sdpa_block, (q, k, v), weight)
        torch._dynamo.reset()
        compiled = _grads(torch.compile(sdpa_block, fullgraph=True), (q, k, v), weight)
        shards = [t.clone() for t in (q, k, v)]
    torch._dynamo.reset()
    local = _grads(sdpa_block, shards, weight)  # outside the context: torch's SDPA on this rank's tokens only
    results["context_parallel SDPA"] = (0, _max_diff(compiled, eager), _max_diff(compiled, eager))
    results["context_parallel differs from local SDPA"] = (0, 0.0, -_max_diff(local, eager))

    # SDPA held under another name, compiled in the context (eagerly the mode routes it): it had reached the
    # graph as torch's own when dynamo's list of overridable functions was made while the name was burst's.
    def aliased(q, k, v, weight):
        return _TORCH_SDPA(q, k, v, is_causal=True).transpose(1, 2).flatten(2) @ weight

    q, k, v = (t.clone() for t in shards)
    _forget_overridable_functions()  # as in a process that had not listed them yet
    with burst.context_parallel(buffers=[], buffer_seq_dims=[]):
        eager = _grads(aliased, (q, k, v), weight)
        torch._dynamo.reset()
        results["context_parallel SDPA by another name"] = (
            None,
            _max_diff(_grads(torch.compile(aliased), (q, k, v), weight), eager),
            0.0,
        )

        # ... and in a checkpointed block, whose recomputation (and its tracing under compile) runs without the
        # context's mode: the module-level name itself is burst's while the context is open (sdpa_names)
        def recomputed(q, k, v, weight, reentrant=False):
            return checkpoint(aliased, q, k, v, weight, use_reentrant=reentrant)

        torch._dynamo.reset()
        results["context_parallel SDPA by another name, checkpointed"] = (
            None,
            _max_diff(_grads(torch.compile(recomputed), (q, k, v), weight), eager),
            _max_diff(_grads(functools.partial(recomputed, reentrant=True), (q, k, v), weight), eager),
        )

    # Under bf16 autocast: the op gets q, k, v in bf16 (as SDPA would) and keeps float32 statistics.
    (q, k, v), weight = _inputs(5, "zigzag")

    def autocast_attend(q, k, v, weight):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return burst.attention(q, k, v, causal=True, layout="zigzag").flatten(2).float() @ weight

    torch._dynamo.reset()
    eager = _grads(autocast_attend, (q, k, v), weight)
    compiled = _grads(torch.compile(autocast_attend, fullgraph=True), (q, k, v), weight)
    results["bf16 autocast"] = (0, _max_diff(compiled, eager), _max_diff(compiled, eager))  # the same kernels run

    # One tensor as both keys and values (DeepSeek-V4's K = V): the op's backward returns its gradient once.
    (q, k, _), weight = _inputs(6, "zigzag")

    def shared(q, k, weight):
        return burst.attention(q, k, k, causal=True, layout="zigzag").flatten(2) @ weight

    torch._dynamo.reset()
    eager = _grads(shared, (q, k), weight)
    compiled = _grads(torch.compile(shared, fullgraph=True), (q, k), weight)
    results["values are keys"] = (0, _max_diff(compiled, eager), _max_diff(compiled, eager))

    # Ranks that disagree (a window on one rank only) raise on every rank, as eager burst.attention does.
    (q, k, v), weight = _inputs(4, "contiguous")

    def uneven(q, k, v):
        return burst.attention(q, k, v, causal=True, window=(8, 0) if rank == 0 else None)

    torch._dynamo.reset()
    try:
        torch.compile(uneven, fullgraph=True)(q, k, v)
        disagreement = "no error"
    except ValueError as err:
        disagreement = str(err)

    # Outside the op's schema: a block-sparse mask runs eagerly behind a graph break, still right.
    from burst.masks import BlockSparseMask

    mask = BlockSparseMask(16, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool))
    (q, k, v), weight = _inputs(2, "contiguous")

    def sparse(q, k, v, weight):
        return F.silu(burst.attention(q, k, v, causal=True, block_sparse=mask).flatten(2) @ weight)

    torch._dynamo.reset()
    eager = _grads(sparse, (q, k, v), weight)
    results["block-sparse (eager path)"] = (
        None,
        _max_diff(_grads(torch.compile(sparse), (q, k, v), weight), eager),
        0.0,
    )
    # nn.MultiheadAttention compiled inside burst.context_parallel with a buffer given (positions held): it had
    # failed with torch's NestedTensor assertion, dynamo mistracing the mode's position check.
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    tokens = torch.randn(1, SEQ, 16, generator=torch.Generator().manual_seed(6))

    def attend(x):
        return mha(x, x, x, need_weights=False)[0]

    def mha_grads(fn):
        x = tokens.clone()
        with burst.context_parallel(buffers=[x], buffer_seq_dims=[1]):
            mha.zero_grad()
            fn(x.requires_grad_()).square().sum().backward()
        return [p.grad.clone() for p in mha.parameters()]

    torch._dynamo.reset()
    results["nn.MultiheadAttention in context_parallel"] = (
        None,
        _max_diff(mha_grads(torch.compile(attend)), mha_grads(attend)),
        0.0,
    )
    torch._dynamo.reset()  # whole: the agreement on its call is not traced
    results["nn.MultiheadAttention in context_parallel, fullgraph"] = (
        None,
        _max_diff(mha_grads(torch.compile(attend, fullgraph=True)), mha_grads(attend)),
        0.0,
    )

    def with_weights(x):  # need_weights=True, its default: refused
        return mha(x, x, x)[0]

    torch._dynamo.reset()
    try:  # burst's refusal on every rank, not dynamo's error from tracing the agreement's collectives
        mha_grads(torch.compile(with_weights))
        refusal = None
    except ValueError as err:
        refusal = str(err)
    return results, disagreement, refusal


def _forget_overridable_functions() -> None:
    """Empty torch's and dynamo's caches of the overridable functions (torch private; skipped if renamed)."""
    import torch._dynamo.variables.torch as dynamo_torch
    import torch.overrides

    for cached in (
        getattr(torch.overrides, "_get_overridable_functions", None),
        dynamo_torch.__dict__.get("get_overridable_functions"),
    ):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


# torch's SDPA as code holds it under another name (`from torch.nn.functional import ... as sdpa`)
_TORCH_SDPA = F.scaled_dot_product_attention

_results = results_by_world(_cases)


def test_compiled_attention_has_no_graph_break_and_equals_eager():
    for rank, (results, _, _) in enumerate(_results(2)):
        for name, (breaks, compiled, _) in results.items():
            assert breaks in (0, None), (rank, name, breaks)
            assert compiled < 1e-5, (rank, name, compiled)


def test_ranks_that_disagree_raise_on_every_rank_under_compile():
    for rank, (_, disagreement, _) in enumerate(_results(2)):
        assert "window" in disagreement, (rank, disagreement)


def test_a_refused_multi_head_attention_under_compile_raises_burst_s_error():
    for rank, (_, _, refusal) in enumerate(_results(2)):
        assert refusal is not None and "need_weights=False" in refusal, (rank, refusal)


def test_compiled_checkpointed_block_equals_eager():
    for rank, (results, _, _) in enumerate(_results(2)):
        for name, (_, _, checkpointed) in results.items():
            assert checkpointed < 1e-5, (rank, name, checkpointed)
        # the check can fail: torch's SDPA on one rank's tokens is far from the whole sequence's attention
        assert -results["context_parallel differs from local SDPA"][2] > 1e-2


def test_every_keyword_is_carried_by_the_op_or_sends_the_call_eagerly():
    """The op's schema lists burst.attention's keywords a second time (custom_op.Settings, and the two ops'
    parameters): a keyword added to AttentionRequest and to neither would be dropped under compile. Each
    field is carried (by name; group by its name, options as names and values) or, when set, makes
    `takes` refuse the op (the call then runs eagerly behind a graph break)."""
    import dataclasses
    import inspect

    from burst import custom_op
    from burst.call import AttentionRequest
    from burst.masks import BlockSparseMask

    carried = set(custom_op.Settings._fields) - {"group_name", "option_names", "option_values", "option_words"}
    carried |= {"group", "options"}
    eager_only = {
        "block_sparse": BlockSparseMask(4, torch.ones(2, 2, dtype=torch.bool)),
        "topology": burst.Topology(1),
        "indices": torch.zeros(1, 1, 1, 1, dtype=torch.long),
        "compressed": object(),
        "layout": burst.DocumentLayout((0, 8)),  # a name is carried; a DocumentLayout is not
    }
    for f in dataclasses.fields(AttentionRequest):
        assert f.name in carried or f.name in eager_only, f"AttentionRequest.{f.name} is neither carried nor refused"
    for name, value in eager_only.items():
        assert not custom_op.takes(AttentionRequest(**{name: value})), name
    assert custom_op.takes(AttentionRequest())
    for op in (custom_op._attention_op, custom_op._attention_backward_op):
        parameters = list(inspect.signature(op._init_fn if hasattr(op, "_init_fn") else op).parameters)
        assert parameters[-len(custom_op.Settings._fields) :] == list(custom_op.Settings._fields), op


def test_values_of_other_types_send_the_call_eagerly_where_validation_names_them():
    """The op's settings converted what they carry (bool(causal), float(scale), an empty window as none):
    under compile causal="False" ran causal, window=() ran without a window, softcap="2.0" ran (a helper's
    probe). Each goes eagerly now, where burst.attention refuses it, as it does uncompiled."""
    from burst import custom_op
    from burst.call import AttentionRequest

    odd = {
        "causal": ["False", None, 1],
        "return_lse": [1],
        "window": [(), [], (3,), (3, 0, 1)],
        "softcap": ["2.0", True],
        "softmax_scale": ["0.5", True, torch.tensor(0.5)],
    }
    for name, values in odd.items():
        for value in values:
            assert not custom_op.takes(AttentionRequest(**{name: value})), (name, value)
    for name, value in {"causal": True, "window": (3, 0), "softcap": 2.0, "softmax_scale": 0.5}.items():
        assert custom_op.takes(AttentionRequest(**{name: value})), (name, value)
    for value in ("keys, queries", "a=b", "", True, 1.5, (1, 2)):  # what name=word,... could not carry back
        assert not custom_op.takes(AttentionRequest(options={"backward_side": value})), value
    assert custom_op.takes(AttentionRequest(options={"backward_side": "keys", "chunk_rows": 8}))
