"""burst.attention's preparation: validation and cross-rank agreement, up to the chosen Strategy and its
AttentionCall, without running it.

Shared downwards by the eager API (api.py), the torch.compile custom op (custom_op.py) and the engine's
checkpointing, so that none of them imports another to prepare a call.
"""

from __future__ import annotations


from .agreement import agree
from .call import AttentionCall, AttentionRequest
from .comm.membership import check_member, group_rank, group_size
from .comm.p2p import open_host_channels
from .plan.auto import auto_choice
from .sinks import check_sinks
from .strategies import STRATEGIES
from .validation import check_tensors, checked_call, checked_key_call


def prepare_attention(q, keys, request: AttentionRequest, sinks=None):
    """burst.attention's validation and cross-rank agreement, without running it: the chosen
    Strategy and its AttentionCall, for callers that drive forward and backward themselves (the
    engine's rematerialization-aware checkpointing replays a stored output into strategy.backward).

    keys: the key side (burst/keys.py): KeyBlocks(k, v), or burst/latent.py's LatentKeys for latent=; or the
        error making it raised on this rank, raised here on every rank by the agreement.
    request: the call's keywords (AttentionRequest.of(**keywords) takes burst.attention's).
    Same errors as burst.attention (which is `strategy(call, q, keys.ready(q))` on the result).
    """
    group = request.group
    check_member(group)
    world = group_size(group)
    rank = group_rank(group)
    problem, call, name = None, None, None
    try:
        if isinstance(keys, Exception):
            raise keys
        name, call = checked_key_call(q, keys, request, rank, world, auto=auto_choice)
        check_sinks(sinks, q)
        keys.check_entries(request.compressed, q, q.shape[1] * world)
    except (TypeError, ValueError, NotImplementedError) as err:
        problem = err
    facts = _call_facts(q, keys, name, call, request, sinks) if problem is None else None
    agree("burst.attention", facts, problem, group, world, hints=_HINTS)
    if world > 1:
        open_host_channels(group)  # collective on a group's first call: every rank has agreed to run it
    return STRATEGIES[name], call


def prepare_single_device(q, k, causal: bool = True, softmax_scale=None):
    """prepare_attention's (Strategy, AttentionCall) for one process holding the whole sequence: no
    group and no collective, even inside a distributed program (the engine's single-device model)."""
    check_tensors(q, k, k)
    request = AttentionRequest(strategy="allgather", causal=causal, softmax_scale=softmax_scale)
    name, call = checked_call(q, k, k, request, 0, 1)
    return STRATEGIES[name], call


_HINTS = {"seqlen": " (shard with burst.shard, or pad every rank to one length)"}


def _shape_and_dtype(t):
    return None if t is None else (tuple(t.shape), str(t.dtype))


def _call_facts(q, keys, name: str, call: AttentionCall, request: AttentionRequest, sinks=None) -> dict:
    """What must be equal on every rank for the call to be right: shard shapes, dtype, options, and the
    key side's (keys.facts(): K, V's heads, or MLA's latent shapes)."""
    compressed = request.compressed
    spec = call.spec
    facts = {
        "batch": q.shape[0],
        "seqlen": q.shape[1],
        "heads": q.shape[2],
        "head_dim": q.shape[3],
        "dtype": str(q.dtype),
        "strategy": name,
        "layout": call.layout,
        "causal": spec.causal,
        "window": spec.window,
        "softmax_scale": call.scale,
        "return_lse": bool(request.return_lse),
        "cu_seqlens": spec.cu_seqlens,
        "softcap": float(request.softcap),  # chunks are in cu_seqlens
        # the rows' choices travel with the queries: another dtype on one rank is another message size
        "indices": None if call.indices is None else (_shape_and_dtype(call.indices), call.index_block),
        "block_sparse": spec.block_sparse.fingerprint if spec.block_sparse is not None else None,
        "topology": (call.topology.local_world_size, call.topology.double_ring),
        "sinks": None if sinks is None else (str(sinks.dtype), tuple(sinks.detach().float().tolist())),
        "compressed": None
        if compressed is None
        else (tuple(compressed.k.shape), compressed.rate, _shape_and_dtype(compressed.indices)),
    }
    facts.update(keys.facts())
    facts.update((f"option {key}", value) for key, value in sorted(call.options.as_dict().items()))
    return facts
