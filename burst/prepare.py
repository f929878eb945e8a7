"""burst.attention's preparation: validation and cross-rank agreement, up to the chosen Strategy and its
AttentionCall, without running it.

Shared downwards by the eager API (api.py), the torch.compile custom op (custom_op.py) and the engine's
checkpointing, so that none of them imports another to prepare a call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .agreement import agree
from .call import AttentionCall
from .comm.p2p import open_host_channels
from .plan.auto import auto_choice
from .compressed import check_compressed
from .latent import check_latent
from .sinks import check_sinks
from .strategies import STRATEGIES
from .validation import check_tensors, checked_call


def prepare_attention(q, k, v, group=None, strategy="burst", layout="contiguous", causal=False, window=None,
                      softmax_scale=None, return_lse=False, cu_seqlens=None, block_sparse=None, topology=None,
                      sinks=None, softcap=0.0, chunk_size=None, indices=None, compressed=None, latent=None, **options):
    """burst.attention's validation and cross-rank agreement, without running it: the chosen
    Strategy and its AttentionCall, for callers that drive forward and backward themselves (the
    engine's rematerialization-aware checkpointing replays a stored output into strategy.backward).

    Same arguments and errors as burst.attention (which is `strategy(call, q, k, v)` on the result).
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    problem, call, name = None, None, None
    try:
        name, call = checked_call(q, k, v, group, rank, world, strategy, layout, causal, window, softmax_scale,
                                  cu_seqlens, block_sparse, options, topology, auto=auto_choice, softcap=softcap,
                                  chunk_size=chunk_size, indices=indices)
        check_sinks(sinks, q)
        check_compressed(compressed, q, v, q.shape[1] * world)
        if latent is not None:
            _check_latent_call(latent, q, name, call, compressed)
    except (TypeError, ValueError, NotImplementedError) as err:
        problem = err
    facts = _call_facts(q, k, name, call, return_lse, sinks, softcap, compressed, v is k) if problem is None else None
    if facts is not None and latent is not None:
        facts["latent"] = (tuple(latent.latent.shape), tuple(latent.rope_rows().shape), tuple(latent.weight.shape),
                           latent.nope_dim, latent.value_dim)
    agree("burst.attention", facts, problem, group, world, hints=_HINTS)
    if world > 1:
        open_host_channels(group)  # collective on a group's first call: every rank has agreed to run it
    return STRATEGIES[name], call


def _check_latent_call(latent, q, name, call, compressed) -> None:
    """latent= (burst/latent.py): burst's ring and key-side backward move it; what it does not take yet."""
    check_latent(latent, q)
    if name != "burst":
        raise ValueError(f"latent=: strategy {name!r} does not move MLA's latent; strategy='burst' does (its key side)")
    if call.options.backward_side == "queries":
        raise ValueError("latent=: burst's backward moves the latent (its key side); backward_side='queries' would "
                         "move every expanded head's queries")
    if compressed is not None:
        raise ValueError("latent= does not take compressed entries (not built: no MLA family uses them)")


def prepare_single_device(q, k, causal: bool = True, softmax_scale=None):
    """prepare_attention's (Strategy, AttentionCall) for one process holding the whole sequence: no
    group and no collective, even inside a distributed program (the engine's single-device model)."""
    check_tensors(q, k, k)
    name, call = checked_call(q, k, k, None, 0, 1, "allgather", "contiguous", causal, None, softmax_scale, None,
                              None, {})
    return STRATEGIES[name], call


def unit_stride_last(t: torch.Tensor) -> torch.Tensor:
    """Any strides are fine (transposed views, slices) except along head_dim: the attention kernels
    read each head's vector as one run (aten's CPU flash op silently misreads a strided last dim), so
    only a tensor whose head_dim is strided is copied."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


_HINTS = {"seqlen": " (shard with burst.shard, or pad every rank to one length)"}


def _call_facts(q, k, name: str, call: AttentionCall, return_lse: bool, sinks=None, softcap=0.0,
                compressed=None, values_are_keys: bool = False) -> dict:
    """What must be equal on every rank for the call to be right: shard shapes, dtype, options."""
    spec = call.spec
    facts = {
        "batch": q.shape[0], "seqlen": q.shape[1], "heads": q.shape[2], "kv_heads": k.shape[2],
        "head_dim": q.shape[3], "dtype": str(q.dtype), "strategy": name, "layout": call.layout,
        "causal": spec.causal, "window": spec.window, "softmax_scale": call.scale, "return_lse": bool(return_lse),
        "cu_seqlens": spec.cu_seqlens, "softcap": float(softcap),  # chunks are in cu_seqlens
        "indices": None if call.indices is None else tuple(call.indices.shape),
        "block_sparse": spec.block_sparse.fingerprint if spec.block_sparse is not None else None,
        "topology": (call.topology.local_world_size, call.topology.double_ring),
        "sinks": None if sinks is None else (str(sinks.dtype), tuple(sinks.detach().float().tolist())),
        "values are keys": values_are_keys,  # v is k: one K, V block travels (strategies.base.travelling_kv)
        "compressed": None if compressed is None else (tuple(compressed.k.shape), compressed.rate,
                                                       compressed.indices is not None),
    }
    facts.update((f"option {key}", value) for key, value in sorted(call.options.as_dict().items()))
    return facts
