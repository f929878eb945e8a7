"""Cost model: time, bytes per link and memory per device of each strategy for one workload.

Units: seconds, bytes. One attention layer's forward and backward (the forward alone for a
prefill: Workload.forward_only) is modelled, then multiplied by the number of layers. Per device, with n = N/G tokens:

- compute: forward 4·B·N²·H·d FLOPs (half with a causal mask; zigzag/striped balance it), backward
  2.5x the forward (flash backward: five matmuls against two), split evenly over G devices;
- a ring step moves one block while the previous one is computed (double buffering): its time is
  max(compute, transfer) and min(compute, transfer) of its transfer is hidden. A link's transfer
  time is latency + bytes / bandwidth (burstengine.md Table 1's T = Lat + P/B);
- a flat ring over several nodes runs at the pace of its node-boundary link; the double ring
  (burstengine.md §3.1) runs intra-node sub-rings inside each inter-node step, so an inter-node
  transfer has a whole sub-ring of compute to hide behind;
- collectives (all-gather, all-to-all, CQS's exchange) are not overlapped with compute.

Volumes per device follow our implementations (the same numbers CommStats reports): burst's backward
moves the smaller side: Q, dO (input dtype), D, lse (fp32) for G-1 steps and dQ (fp32) for G (across
nodes, on the ring) or G-1 (one node: the chunk stream sends each dQ part straight home,
strategies/burst_stream.py), or, with grouped heads, K, V and dK, dV the same way;
ring's moves K, V for G-1 and dK, dV (fp32) for G. Of the masks beyond causal only a sliding window is
modelled (windows.py); a causal mask makes the chunk stream send less than this. Memory is what
attention holds per device: the inputs, outputs and lse saved for backward in every layer, plus one
layer's backward peak (gradients, travelling buffers, and whatever the strategy gathers). Model
weights and MLP activations are not included here: model_cost.py adds the rest of the model,
contention and synchronisation on top of this. The Workload, Cluster and Estimate, and the time of
a ring pass or a collective, are cost_terms.py's.
"""

from __future__ import annotations

from dataclasses import replace

from ..schedules.chunk_stream import CHUNKS_PER_BLOCK
from ..schedules.cqs import interest_set
from ..strategies import split_variant
from .cost_terms import Cluster, Estimate, Workload, collective_time, ring_pass
from .rings import RING_BLOCKS
from .sparse import add_gathers
from ..strategies.usp import default_degree
from .windows import balanced, blend, layer_pairs, ring_steps, served_share

STRATEGIES = ("burst", "ring", "burst:flat", "ring:flat", "distflash", "allgather", "ulysses", "usp", "cqs")
BACKWARD_FLOPS_RATIO = 2.5
# Strategies whose work per rank follows the layout's shard (Ulysses and CQS rebalance by design,
# DistFlashAttn's schedule balances contiguous shards).
_BY_SHARD = ("burst", "ring", "burst:flat", "ring:flat", "allgather")
_ring_pass = ring_pass  # tests/test_plan.py's name for it


class _Sizes:
    """Block sizes in bytes for one device's shard of n = N/G tokens."""

    def __init__(self, w: Workload, g: int, dtype_bytes: int):
        n = w.seq_len / g
        self.n, self.dtype_bytes = n, dtype_bytes
        self.q = w.batch * n * w.heads * w.head_dim * dtype_bytes  # one of Q, dO, O
        self.kv = 2 * w.batch * n * w.kv * w.head_dim * dtype_bytes  # K and V
        self.stat = w.batch * n * w.heads * 4  # one of lse, D (fp32)
        self.dq32 = w.batch * n * w.heads * w.head_dim * 4
        self.dkv32 = 2 * w.batch * n * w.kv * w.head_dim * 4


def pair_flops(pairs: float, batch: int, heads: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of attending `pairs` (query, key) pairs: 4·batch·heads·head_dim per
    pair forward (QK^T and PV, a multiply-add each), BACKWARD_FLOPS_RATIO times that backward. The
    one formula: the planner, `burst bench` and the calibration all count with it."""
    fwd = 4.0 * batch * heads * head_dim * pairs
    return fwd, BACKWARD_FLOPS_RATIO * fwd


def attention_flops(w: Workload) -> tuple[float, float]:
    """(forward, backward) FLOPs of one attention layer over the whole sequence (causal: half the pairs;
    a causal window: the pairs it leaves, windows.py; plus the compressed entries each query attends,
    and DeepSeek sparse attention's indexer scoring)."""
    pairs = layer_pairs(w.seq_len, w.causal, w.window) + w.seq_len * w.entries
    fwd, bwd = pair_flops(pairs, w.batch, w.heads, w.head_dim)
    return fwd + 2.0 * w.batch * w.seq_len * w.indexer_macs, bwd  # the indexers score in the forward, no gradient


def estimate(strategy: str, cluster: Cluster, w: Workload) -> Estimate:
    """The modelled cost of `strategy` on `cluster` for `w` (all layers, forward + backward; the
    forward alone when w.forward_only)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; modelled: {STRATEGIES}")
    if w.causal and w.window is not None and w.windowed_share < 1:  # windowed and full layers, each costed
        return blend(
            estimate(strategy, cluster, replace(w, windowed_share=1.0)),
            estimate(strategy, cluster, replace(w, window=None)),
            w.windowed_share,
        )
    dtype_bytes = w.dtype_bytes or cluster.profile.dtype_bytes
    s = _Sizes(w, cluster.gpus, dtype_bytes)
    fwd_flops, bwd_flops = attention_flops(w)
    c_fwd = fwd_flops / cluster.gpus / cluster.profile.flops  # per device, one layer
    c_bwd = 0.0 if w.forward_only else bwd_flops / cluster.gpus / cluster.profile.flops
    if (
        w.causal
        and w.layout == "contiguous"
        and strategy in _BY_SHARD
        and not balanced(w.seq_len, cluster.gpus, w.window)
    ):
        # The last rank's queries see G - 1/2 blocks where the average sees G/2: it sets the pace.
        straggler = (2 * cluster.gpus - 1) / cluster.gpus
        c_fwd, c_bwd = c_fwd * straggler, c_bwd * straggler
    est = _MODELS[split_variant(strategy)[0]](strategy, cluster, w, s, c_fwd, c_bwd)
    add_gathers(est, cluster, w, s, collective_time)  # sparse attention's gathers: sparse.py
    saved = w.layers * (3 * s.q + s.kv + s.stat) if w.kv == w.heads else w.layers * (2 * s.q + s.kv + s.stat)
    est.mem_bytes_per_device += saved
    for attr in (
        "compute_s",
        "comm_s",
        "exposed_comm_s",
        "wall_s",
        "inter_node_bytes_per_device",
        "intra_node_bytes_per_device",
    ):
        setattr(est, attr, getattr(est, attr) * w.layers)
    est.fits = est.fits and est.mem_bytes_per_device <= cluster.profile.memory_bytes
    if est.mem_bytes_per_device > cluster.profile.memory_bytes:
        est.note = (est.note + "; " if est.note else "") + "does not fit in device memory"
    return est


def _ring_family(name, cluster, w, s, c_fwd, c_bwd) -> Estimate:
    """burst and ring, on the double ring (across nodes; the flat ring on one) or, as "burst:flat" /
    "ring:flat", the flat ring: the forward is the same K, V ring for both."""
    base, variant = split_variant(name)
    double = variant != "flat"
    window = w.window if w.causal else None
    g = ring_steps(w.seq_len, cluster.gpus, window, w.layout)  # a window stops it early
    b = RING_BLOCKS[base](w, s, cluster.nodes == 1)  # what this strategy moves per block (rings.py)
    f = served_share(w.seq_len, cluster.gpus, window, w.layout) if b.streamed else 1.0
    c_fwd, c_bwd = (c + x / cluster.gpus / cluster.profile.flops for c, x in zip((c_fwd, c_bwd), b.expansion))
    fwd = ring_pass(cluster, g, c_fwd, b.forward * f, double)  # f: the chunk stream serves only a window's rows
    staying = s.dkv32 + s.q if b.side == "queries" else s.dq32 + s.q  # the other side's accumulators, and O
    if b.streamed:  # the chunk stream: a few chunks held, accumulator parts go home
        bwd = _backward(
            w, lambda: ring_pass(cluster, g, c_bwd, (b.moving + b.acc) * f, False, tail=b.acc * f / CHUNKS_PER_BLOCK)
        )
        peak = b.acc + staying - s.q + (2 * b.moving + 3 * b.acc + s.q) / CHUNKS_PER_BLOCK
    else:  # whole blocks on the (double) ring, their accumulators taking the last hop home
        bwd = _backward(w, lambda: ring_pass(cluster, g, c_bwd, b.moving + b.acc, double, tail=b.acc))
        peak = 2 * b.moving + 2 * b.acc + staying
    est = _sum(name, fwd, bwd, c_fwd + c_bwd)
    est.mem_bytes_per_device = peak
    notes = [f"one node: the same ring as {base}"] if not double and cluster.nodes == 1 else []
    if b.note and not w.forward_only:
        notes.append(b.note)
    est.note = "; ".join(notes)
    return est


_NO_PASS = (0.0, 0.0, 0.0, 0.0, 0.0)


def _backward(w: Workload, run):
    """The backward pass's (wall, link, exposed, inter, intra), or nothing in a prefill."""
    return _NO_PASS if w.forward_only else run()


def _sum(name, fwd, bwd, compute) -> Estimate:
    return Estimate(
        name,
        compute_s=compute,
        wall_s=fwd[0] + bwd[0],
        comm_s=fwd[1] + bwd[1],
        exposed_comm_s=fwd[2] + bwd[2],
        inter_node_bytes_per_device=fwd[3] + bwd[3],
        intra_node_bytes_per_device=fwd[4] + bwd[4],
    )


def _allgather(name, cluster, w, s, c_fwd, c_bwd) -> Estimate:
    g = cluster.gpus
    share = 0.0 if cluster.nodes == 1 else (g - cluster.gpus_per_node) / (g - 1) if g > 1 else 0.0
    gather = collective_time(cluster, (g - 1) * s.kv, share)
    scatter = collective_time(cluster, 0.0 if w.forward_only else (g - 1) * s.dkv32, share)
    gathers = 1 if w.forward_only else 2  # the backward gathers K, V again
    comm = gathers * gather[0] + scatter[0]
    est = Estimate(
        name,
        compute_s=c_fwd + c_bwd,
        comm_s=comm,
        exposed_comm_s=comm,
        wall_s=c_fwd + c_bwd + comm,
        inter_node_bytes_per_device=gathers * gather[1] + scatter[1],
        intra_node_bytes_per_device=gathers * gather[2] + scatter[2],
    )
    est.mem_bytes_per_device = g * (s.kv + s.dkv32) + s.dq32 + s.q
    est.note = "holds the whole sequence's K, V"
    return est


def _ulysses_volumes(s: _Sizes, w: Workload, degree: int) -> tuple[float, float]:
    """Bytes one device sends in the forward and backward all-to-alls of a Ulysses group of `degree`.

    KV heads: with fewer KV heads than ranks each KV head goes to every rank that needs it, once.
    """
    if degree == 1:
        return 0.0, 0.0
    share = (degree - 1) / degree  # what leaves this device
    copies = max(w.kv, degree) / w.kv  # a KV head reaches degree / kv ranks when kv < degree
    fwd = 2 * s.q * share + s.kv * copies * share  # Q, K, V to head shards; O back
    bwd = s.q * share + s.dq32 * share + s.dkv32 * copies * share  # dO in; dQ, dK, dV (fp32) back
    return fwd, bwd


def _ulysses(name, cluster, w, s, c_fwd, c_bwd, degree=None) -> Estimate:
    g = degree or cluster.gpus
    est = Estimate(name, compute_s=c_fwd + c_bwd)
    if w.heads % g:
        est.fits, est.note = False, f"{w.heads} heads do not split over {g} ranks"
    fwd, bwd = _ulysses_volumes(s, w, g)
    bwd = 0.0 if w.forward_only else bwd
    share = 0.0 if g <= cluster.gpus_per_node else (g - cluster.gpus_per_node) / (g - 1)
    t_f, t_b = collective_time(cluster, fwd, share), collective_time(cluster, bwd, share)
    est.comm_s = est.exposed_comm_s = t_f[0] + t_b[0]
    est.wall_s = est.compute_s + est.comm_s
    est.inter_node_bytes_per_device, est.intra_node_bytes_per_device = t_f[1] + t_b[1], t_f[2] + t_b[2]
    est.mem_bytes_per_device = 2 * (3 * s.q + s.kv) + s.dq32 + s.dkv32  # both layouts live during the swap
    return est


def _usp(name, cluster, w, s, c_fwd, c_bwd) -> Estimate:
    """Ulysses inside a node (the degree burst.attention's USP takes by default: usp.default_degree), the
    burst ring across nodes on the remaining degree (BurstEngine's head-first placement)."""
    u = default_degree(w.heads, w.kv, cluster.gpus_per_node, cluster.gpus)
    r = cluster.gpus // u
    inner = _ulysses(name, Cluster(u, u, cluster.profile, cluster.intra_bw, cluster.inter_bw), w, s, 0.0, 0.0, u)
    # The ring carries the full sequence's share of the ring group: blocks of N/r tokens, H/u heads.
    ring_sizes = _Sizes(
        Workload(w.seq_len, max(1, w.heads // u), w.head_dim, max(1, w.kv // u), w.batch, 1, w.causal, None),
        r,
        s.dtype_bytes,
    )
    # the ring's members are u ranks apart: a node of P ranks holds P/u of them (one when u >= P)
    per_node = max(1, min(r, cluster.gpus_per_node // u))
    ring_cluster = Cluster(r, per_node, cluster.profile, cluster.intra_bw, cluster.inter_bw) if r > 1 else cluster
    fwd = ring_pass(ring_cluster, r, c_fwd, ring_sizes.kv, False)
    bwd = _backward(
        w,
        lambda: ring_pass(
            ring_cluster,
            r,
            c_bwd,
            2 * ring_sizes.q + 2 * ring_sizes.stat + ring_sizes.dq32,
            False,
            tail=ring_sizes.dq32,
        ),
    )
    est = _sum(name, fwd, bwd, c_fwd + c_bwd)
    est.wall_s += inner.comm_s
    est.comm_s += inner.comm_s
    est.exposed_comm_s += inner.comm_s
    est.intra_node_bytes_per_device += inner.inter_node_bytes_per_device + inner.intra_node_bytes_per_device
    est.mem_bytes_per_device = inner.mem_bytes_per_device + 2 * ring_sizes.kv
    est.extra = {"ulysses_degree": u, "ring_degree": r}
    est.note = f"ulysses {u} x ring {r}"
    return est


def _distflash(name, cluster, w, s, c_fwd, c_bwd) -> Estimate:
    """DistFlashAttn's balanced causal schedule: G/2 steps after the diagonal, each moving K, V to
    the owner and (for helpers) Q one way and partial results back; causal only."""
    g = cluster.gpus
    steps = g // 2 + 1
    fwd = ring_pass(cluster, steps, c_fwd, s.kv + 0.5 * (s.q + s.dq32 + s.stat), False)
    bwd = _backward(
        w, lambda: ring_pass(cluster, steps, c_bwd, s.kv + s.dkv32 + 0.5 * (2 * s.q + 2 * s.stat + s.dq32), False)
    )
    est = _sum(name, fwd, bwd, c_fwd + c_bwd)
    est.mem_bytes_per_device = 2 * s.kv + 2 * s.dkv32 + s.dq32 + 2 * s.q
    if not w.causal:
        est.fits, est.note = False, "causal masks only"
    return est


def quorum_size(g: int) -> int:
    """Size of CQS's interest set for g workers."""
    return len(interest_set(g))


def _cqs(name, cluster, w, s, c_fwd, c_bwd) -> Estimate:
    """CQS-Attention: one exchange brings each worker its quorum's token groups (Q, K, V), it
    computes its block pairs without talking, and returns partial results to their owners."""
    g = cluster.gpus
    k = quorum_size(g)
    share = 0.0 if cluster.nodes == 1 else (g - cluster.gpus_per_node) / max(1, g - 1)
    fetch = (k - 1) * (s.q + s.kv)
    back = (k - 1) * (s.dq32 + s.stat)
    t_f = [collective_time(cluster, fetch, share), collective_time(cluster, back, share)]
    bwd_fetch = 0.0 if w.forward_only else (k - 1) * (2 * s.q + s.kv + 2 * s.stat)
    bwd_back = 0.0 if w.forward_only else (k - 1) * (s.dq32 + s.dkv32)
    t_b = [collective_time(cluster, bwd_fetch, share), collective_time(cluster, bwd_back, share)]
    comm = sum(t[0] for t in t_f + t_b)
    est = Estimate(
        name,
        compute_s=c_fwd + c_bwd,
        comm_s=comm,
        exposed_comm_s=comm,
        wall_s=c_fwd + c_bwd + comm,
        inter_node_bytes_per_device=sum(t[1] for t in t_f + t_b),
        intra_node_bytes_per_device=sum(t[2] for t in t_f + t_b),
    )
    est.mem_bytes_per_device = k * (2 * s.q + s.kv + s.dkv32) + k * s.dq32
    est.extra = {"quorum": k}
    return est


_MODELS = {
    "burst": _ring_family,
    "ring": _ring_family,
    "allgather": _allgather,
    "ulysses": _ulysses,
    "usp": _usp,
    "distflash": _distflash,
    "cqs": _cqs,
}
