"""The local checks of one burst.attention call, and the AttentionCall they build.

Local facts only (shapes, dtypes, options, layout, masks, the strategy's own limits): they run on
every rank before any collective; api.py then makes every rank agree on the outcome. The planner
(plan/takes.py) runs the same checks on stand-in shapes to say which strategies take a workload.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import replace

from .call import AttentionCall, AttentionRequest
from .comm.topology import Topology, default_world_size
from .kernels import select_kernel
from .keys import DTYPES, KeyBlocks, check_tensors  # noqa: F401  (DTYPES, check_tensors: api.py's names too)
from .layout import (
    DOCUMENT_LAYOUTS,
    DocumentLayout,
    check_layout,
    check_sharded_with,
    is_int,
    listed_documents,
    local_multiple,
    resolve_layout,
)
from .masks import BlockSparseMask, MaskSpec, checked_selection
from .strategies import STRATEGIES
from .strategies.base import did_you_mean

STRATEGY_NAMES = tuple(STRATEGIES) + ("auto",)


def checked_call(q, k, v, request: AttentionRequest, rank: int, world: int, auto=None) -> tuple[str, AttentionCall]:
    """checked_key_call with the K, V tensors as the key side (the planner's stand-in shapes)."""
    return checked_key_call(q, KeyBlocks(k, v), request, rank, world, auto)


def checked_key_call(q, keys, request: AttentionRequest, rank: int, world: int, auto=None) -> tuple[str, AttentionCall]:
    """Validate this rank's arguments (local facts only) and build its AttentionCall: (strategy name,
    call). keys: the key side (burst/keys.py), K and V or another kind, which checks itself against q.
    strategy="auto" is resolved by `auto(candidates, call, q, k)` (burst.attention passes the planner's
    burst.plan.auto_choice; a key side only some strategies move takes the first of them); without
    one, "auto" raises."""
    r = request
    keys.check(q)
    layout, cu_seqlens = _document_layout(r.layout, listed_documents(r.cu_seqlens), world, q.shape[1])
    _check_options(r.strategy, layout, r.causal, r.window, r.softmax_scale)
    _check_bool("return_lse", r.return_lse)  # "False" would be truthy: (out, lse) where out was asked for
    check_sharded_with(layout, q=q, k=getattr(keys, "k", None), v=getattr(keys, "v", None))
    _check_softcap_and_chunks(r.softcap, r.chunk_size)
    _check_local_length(q.shape[1], layout)
    global_len = q.shape[1] * world
    if isinstance(layout, DocumentLayout):
        layout.check(world, global_len)
    _check_documents(cu_seqlens, global_len)
    _check_block_sparse(r.block_sparse, global_len)
    indices, index_block = checked_selection(r.indices, q, keys.facts().get("kv_heads", q.shape[2]), global_len)
    spec = MaskSpec(
        causal=r.causal,
        window=_normalized_window(r.window),
        cu_seqlens=_documents_and_chunks(cu_seqlens, r.chunk_size, global_len),
        block_sparse=r.block_sparse,
    )
    call = AttentionCall(
        group=r.group,
        rank=rank,
        world=world,
        layout=layout,
        local_len=q.shape[1],
        spec=spec,
        scale=float(r.softmax_scale) if r.softmax_scale is not None else q.shape[-1] ** -0.5,
        kernel=select_kernel(q.device, q.dtype, float(r.softcap), q.shape[-1], keys.kernel_value_dim(q)),
        topology=_resolved_topology(r.topology),
        indices=indices,
        index_block=index_block,
    )
    if r.strategy == "auto":
        name = keys.strategies[0] if keys.strategies else _auto_strategy(call, q, keys.k, r.options, auto)
    else:
        name = r.strategy
    chosen = STRATEGIES[name]
    _check_takes_indices(chosen, indices)
    call = replace(call, options=chosen.parse_options(r.options))
    keys.check_strategy(name, call)  # before the strategy's own check, which reads K (keys.k)
    if chosen.check is not None:
        chosen.check(call, q, keys.k)
    return name, call


def _document_layout(layout, cu_seqlens, world: int, local_len: int):
    """(layout, global cu_seqlens): a per-document layout named with cu_seqlens (global or the peers'
    local form) becomes a DocumentLayout, whose documents are also the call's document mask."""
    if not isinstance(layout, DocumentLayout) and layout not in DOCUMENT_LAYOUTS:
        return layout, cu_seqlens
    resolved = resolve_layout(layout, cu_seqlens, world, local_len)
    if cu_seqlens is not None:
        given = resolve_layout(f"doc_{resolved.split}", cu_seqlens, world, local_len).cu_seqlens
        if given != resolved.cu_seqlens:
            raise ValueError(
                f"cu_seqlens {list(given)[:6]} differ from the DocumentLayout's documents "
                f"{list(resolved.cu_seqlens)[:6]}; pass one of them"
            )
    return resolved, list(resolved.cu_seqlens)


def _resolved_topology(topology) -> Topology:
    if topology is None:
        topology = Topology()
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a burst.Topology or None, got {type(topology).__name__}")
    world = default_world_size()
    resolved = topology.resolved(world)
    resolved.check(world)
    return resolved


def _auto_strategy(call: AttentionCall, q, k, options: dict, auto) -> str:
    """`auto`'s choice among the strategies that take this call, from facts every rank shares
    (shapes, world, topology, device kind), so "auto" resolves alike everywhere."""
    if auto is None:
        raise ValueError("strategy='auto' needs the planner's choice here; name a strategy")
    takes, refusals = [], {}
    for name, strategy in STRATEGIES.items():
        if call.indices is not None and not strategy.takes_indices:
            refusals[name] = "runs no index selections (indices=)"
            continue
        try:
            parsed = strategy.parse_options(options)
            if strategy.check is not None:
                strategy.check(replace(call, options=parsed), q, k)
        except (ValueError, NotImplementedError) as err:
            refusals[name] = str(err)
            continue
        takes.append(name)
    if not takes:
        raise ValueError("strategy='auto': no strategy takes this call; " + _why_none_takes(options, refusals))
    return auto(takes, call, q, k)


def _why_none_takes(options: dict, refusals: dict[str, str]) -> str:
    """The keywords no strategy takes (each with a close match, as a named strategy's error gives it), else
    the refusals of the strategies that take every keyword given (of all, where none does)."""
    taken = {o for strategy in STRATEGIES.values() for o in strategy.options.names()}
    unknown = sorted(set(options) - taken)
    if unknown:
        return f"none takes {', '.join(map(repr, unknown))}" + did_you_mean(unknown, sorted(taken))
    named = {name: why for name, why in refusals.items() if STRATEGIES[name].takes(options)} or refusals
    return "; ".join(f"{name}: {why}" for name, why in named.items())


def _is_number(x) -> bool:
    """A real number, numpy's included; not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def type_path(value) -> str:
    """`value`'s type as a user would import it: "numpy.bool" where its bare name ("bool") would read as Python's."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a Python bool, got {value!r} of type {type_path(value)}")


def _check_options(strategy, layout, causal, window, softmax_scale) -> None:
    if strategy not in STRATEGY_NAMES:
        variant = " ('name:variant' is burst bench's spelling: pass its options)" if ":" in str(strategy) else ""
        raise ValueError(f"strategy must be one of {STRATEGY_NAMES}, got {strategy!r}{variant}")
    check_layout(layout)
    _check_bool("causal", causal)
    if window is not None and not (
        isinstance(window, (tuple, list)) and len(window) == 2 and all(is_int(w) and w >= -1 for w in window)
    ):
        raise ValueError(f"window must be None or (left, right) ints >= -1 (-1 = unbounded), got {window!r}")
    if softmax_scale is not None and not (
        _is_number(softmax_scale) and math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")


def _check_softcap_and_chunks(softcap, chunk_size) -> None:
    if not _is_number(softcap) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = none), got {softcap!r}")
    if chunk_size is not None and (not is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int (tokens per chunk), got {chunk_size!r}")


def _documents_and_chunks(cu_seqlens, chunk_size: int | None, global_len: int) -> tuple[int, ...] | None:
    """The mask's document bounds: the packed documents' and, with chunked attention (Llama 4's
    attention_chunk_size: a token attends inside its fixed chunk of the global sequence only), every
    multiple of chunk_size. Chunks are documents of equal length, so the planner, the ring's early
    stop and the kernels' varlen path treat them as documents."""
    bounds = set(int(x) for x in cu_seqlens) if cu_seqlens is not None else set()
    if chunk_size is not None and chunk_size < global_len:
        bounds.update(range(0, global_len + 1, chunk_size))
        bounds.add(global_len)
    if cu_seqlens is None and not bounds:
        return None
    return tuple(sorted(bounds))


def _check_takes_indices(strategy, indices) -> None:
    if indices is not None and not strategy.takes_indices:
        takers = [name for name, s in STRATEGIES.items() if s.takes_indices]
        raise ValueError(
            f"strategy {strategy.name!r} does not run index selections (indices=): its queries' "
            f"chosen keys would have to travel where it moves them; use one of {takers}"
        )


def _check_local_length(local_len: int, layout: str) -> None:
    if local_len == 0:
        raise ValueError("q holds 0 tokens; every rank needs at least one")
    need = local_multiple(layout)
    if local_len % need:
        raise ValueError(
            f"layout={layout!r} needs the local sequence length to be a multiple of {need}, got {local_len}"
        )


def _check_documents(values: list[int] | None, global_len: int) -> None:
    """values: cu_seqlens as layout.listed_documents read them."""
    if values is None:
        return
    if values[0] != 0 or values[-1] != global_len or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the global sequence length {global_len} "
            f"(ranks x local tokens), got {values[:4]}{'...' if len(values) > 4 else ''} ending {values[-1]}"
        )


def _check_block_sparse(block_sparse, global_len: int) -> None:
    if block_sparse is None:
        return
    if not isinstance(block_sparse, BlockSparseMask):
        raise TypeError(f"block_sparse must be a burst.BlockSparseMask, got {type(block_sparse).__name__}")
    nblocks = -(-global_len // block_sparse.block_size)
    if tuple(block_sparse.layout.shape) != (nblocks, nblocks):
        raise ValueError(
            f"block_sparse.layout has shape {tuple(block_sparse.layout.shape)} but a global length of "
            f"{global_len} in blocks of {block_sparse.block_size} needs ({nblocks}, {nblocks})"
        )


def _normalized_window(window) -> tuple[int, int] | None:
    if window is None or tuple(window) == (-1, -1):
        return None
    return (int(window[0]), int(window[1]))
