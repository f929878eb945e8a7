"""BurstAttention (burstattention.md; burstengine.md §3.1, Alg. 2).

Forward: the same K, V ring with online softmax as RingAttention (strategies/ring.py); on one node,
when a mask needs only part of some rank's keys (a sliding window), those served in chunks instead.
Backward, the query side: K, V, dK, dV stay home; Q, dO, D = rowsum(dO∘O) and lse travel (read-only),
and dQ travels as a float32 accumulator that arrives home. Per row and head that is 3d + 2 numbers
against RingAttention's 4d: about 25% less backward traffic for fp32 and MHA.
With grouped heads (GQA, MQA) the key side is the smaller one: Q has hq heads, K and V hk. Then the
backward moves the key side instead: K, V travel (served in chunks on one node, like the queries), dK,
dV come home as float32 accumulators, and Q, dO, dQ stay home. `backward_side` picks per call from the
call's shapes and dtypes (the same on every rank, so every rank takes the same side), or forces one.

On one node the queries are served in chunks by their owners (strategies/burst_stream.py): the ring's
block pairs in the ring's order, but a rank holds a few chunks of Q, dO, dQ instead of two whole
travelling blocks and two dQ blocks (benchmarks/memory_notes.md). Option `chunk_rows`: rows per
chunk (default: an eighth of the shard, 128 to the kernel's call size, and at least the kernel's floor for
the dtype: cpu_flash's bf16, 2048); 0 runs the paper's ring
of whole blocks, neighbour to neighbour. Across nodes the double ring runs (strategies/ring.py's loop).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..call import AttentionCall
from ..comm.stats import record_choice
from ..comm.topology import nodes_spanned
from ..kernels.accumulators import accumulator_zeros_like, lse_for_backward, row_delta
from ..keys import KeyBlocks, kv_gradients
from .base import Options, Strategy, int_at_least
from .burst_stream import chunk_rows, keys_partly_needed, served_forward, served_key_backward, served_query_backward
from .ring import one_call, ring_backward, ring_forward, ring_key_backward, visit_blocks

BACKWARD_SIDES = ("auto", "queries", "keys")


def burst_forward(call: AttentionCall, q, keys: KeyBlocks):
    """RingAttention's forward (strategies/ring.py), or on one node, when a mask needs only part of some
    rank's keys (a sliding window, local documents), those keys served in chunks by their owners
    (strategies/burst_stream.py): the same block pairs, fewer bytes. Shapes as ring_forward's; `keys`
    may be of any kind (MLA's latent, burst/latent.py)."""
    rows = chunk_rows(call, q.dtype)
    if rows and not call.spec.is_dense and _on_one_node(call) and keys_partly_needed(call, rows):
        return served_forward(call, rows, q, keys)
    return ring_forward(call, q, keys)


def burst_backward(call: AttentionCall, dout, q, keys: KeyBlocks, out, lse):
    """burstengine.md Alg. 2 on the side that moves fewer bytes (backward_side). Shapes as in
    ring_backward; returns dq, dk, dv in input dtypes (another kind of key side, MLA's latent, always
    moves itself: the key side, and its inputs' gradients)."""
    if not isinstance(keys, KeyBlocks):
        record_choice("backward_side", "keys")
        return key_side_backward(call, dout, q, keys, out, lse)
    k, v = keys.k, keys.v
    if one_call(call) is not None:  # one rank, one kernel call: nothing travels, so no side to choose
        return ring_backward(call, dout, q, keys, out, lse)
    side = backward_side(call, dout, q, k, v)
    record_choice("backward_side", side)
    if side == "keys":
        return key_side_backward(call, dout, q, keys, out, lse)
    return _query_side_backward(call, dout, q, k, v, out, lse)


def side_bytes_per_row(q, dout, k, v, indices=None) -> dict[str, int]:
    """Bytes one row of a shard puts on the wire per ring step, each side (batch rows counted once):
    row_bytes for these tensors (k alone when the values are the keys)."""
    return row_bytes(
        heads=q.shape[2],
        head_dim=q.shape[3],
        q_bytes=q.element_size(),
        dout_bytes=dout.element_size(),
        keys=[(t.shape[2] * t.shape[3], t.element_size()) for t in ([k] if v is k else [k, v])],
        index_bytes=0 if indices is None else indices[0, 0].numel() * indices.element_size(),
    )


def row_bytes(
    *, heads: int, head_dim: int, q_bytes: int, dout_bytes: int, keys: list[tuple[int, int]], index_bytes: int = 0
) -> dict[str, int]:
    """Bytes a row puts on the wire per ring step on each side of the backward, by shape alone (the
    planner counts with it too). queries: Q and dO (q_bytes, dout_bytes a number), D and lse (float32),
    the dQ accumulator (float32), and an index selection's chosen keys (index_bytes: they travel with
    their queries); keys: each key-side tensor, (numbers a row, bytes a number), and its float32
    accumulator."""
    queries = heads * head_dim * (q_bytes + dout_bytes + 4) + 2 * heads * 4 + index_bytes
    return {"queries": queries, "keys": sum(numbers * (size + 4) for numbers, size in keys)}


def smaller_side(sizes: dict[str, int]) -> str:
    """ "keys" when they move fewer bytes than the queries, else "queries" (ties: the paper's side)."""
    return "keys" if sizes["keys"] < sizes["queries"] else "queries"


def backward_side(call: AttentionCall, dout, q, k, v) -> str:
    """ "queries" or "keys": the option when it names one, else the smaller side. Shapes and dtypes
    agree across ranks, so every rank picks the same side without a collective."""
    forced = call.options.backward_side
    if forced != "auto":
        return forced
    return smaller_side(side_bytes_per_row(q, dout, k, v, call.indices))


def key_side_backward(call: AttentionCall, dout, q, keys: KeyBlocks, out, lse):
    """K, V (or what `keys` moves) travel to the queries that need them, their gradients (float32) come
    home; Q, dO, dQ stay. On one node the keys' owners serve them in chunks (strategies/burst_stream.py),
    across nodes the ring's backward loop runs on the double ring. Returns dq in q's dtype and
    keys.gradients(...)."""
    rows, lse = chunk_rows(call, q.dtype), lse_for_backward(lse)
    if rows and _on_one_node(call):
        dq, grads = served_key_backward(call, rows, dout, q, keys, out, lse)
    else:
        dq, grads = ring_key_backward(call, dout, q, keys, out, lse)
    return (dq.to(q.dtype), *keys.gradients(grads))


def _query_side_backward(call: AttentionCall, dout, q, k, v, out, lse):
    """Queries meet this rank's keys in the order of call.q_schedule (the forward's pairs, in the same
    order); on one node served chunk by chunk, across nodes on the double ring."""
    delta = row_delta(dout, out)  # D_i, computed once here instead of at every step
    dk = accumulator_zeros_like(k)
    dv = dk if v is k else accumulator_zeros_like(v)  # keys reused as values: one accumulator for both
    travelling = [q, dout, delta, lse_for_backward(lse)]
    if call.indices is not None:  # the queries' chosen keys travel with them (int64, topk per row)
        travelling.append(call.indices)
    rows = chunk_rows(call, q.dtype)
    if rows and _on_one_node(call):
        dq = served_query_backward(call, rows, travelling, out, k, v, dk, dv)
    else:
        dq = _ring_backward(call, travelling, out, k, v, dk, dv)
    return (dq.to(q.dtype), *kv_gradients(dk, dv, k, v))


def _on_one_node(call: AttentionCall) -> bool:
    """The chunk stream's shifts suit one node's switch; across nodes the (double) ring runs, also when
    the topology asks for the flat ring (double_ring=False), which then stays neighbour to neighbour, and
    for a subgroup whose ranks sit on several nodes (USP's ring groups across nodes)."""
    return call.q_schedule.nodes == 1 and nodes_spanned(call.topology, call.group) == 1


def _ring_backward(call: AttentionCall, travelling, out, k, v, dk, dv):
    """Whole blocks of (q, dO, D, lse) around the (double) ring, dQ travelling with them."""

    def attend(src, held, dq_acc):  # the queries of rank src against our keys
        q_j, dout_j, delta_j, lse_j, *indices_j = held
        # Our own queries come with their real output; others' are rebuilt from D tile by tile.
        out_j = out if src == call.rank else None
        call.attend_backward(
            dout_j,
            q_j,
            k,
            v,
            out_j,
            lse_j,
            call.tiles(src, call.rank),
            dq_acc.part(0),
            dk,
            dv,
            delta=delta_j,
            indices=indices_j[0] if indices_j else None,
        )

    (dq,) = visit_blocks(call, call.q_schedule, "backward", travelling, attend, acc_likes=travelling[:1])
    return dq


@dataclass(frozen=True)
class BurstOptions(Options):
    """chunk_rows: rows per served chunk on one node, query or key chunks in the backward and key chunks
    in a masked forward (None: an eighth of the shard, 128 to the kernel's call size, at least the
    kernel's floor for the dtype: schedules/chunk_stream.default_chunk_rows; 0: the paper's ring of whole
    blocks). backward_side: "auto" (the side with fewer bytes: the queries for
    multi-head attention, the keys for most grouped heads), "queries" or "keys"."""

    chunk_rows: int | None = None
    backward_side: str = "auto"

    def __post_init__(self):
        if self.chunk_rows is not None:
            int_at_least("chunk_rows", self.chunk_rows, 0, " (0: whole blocks on the ring)")
        if self.backward_side not in BACKWARD_SIDES:
            raise ValueError(f"backward_side must be one of {BACKWARD_SIDES}, got {self.backward_side!r}")


BURST = Strategy("burst", forward=burst_forward, backward=burst_backward, options=BurstOptions, takes_indices=True)
