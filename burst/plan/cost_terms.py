"""The terms burst/plan/cost.py's model is written in: a Workload (one attention layer's shape), the
Cluster it runs on (devices, nodes, link times), the Estimate a strategy's model returns, and the two
link-time terms every strategy's model is built from: a double-buffered ring pass and a collective.
Units: seconds, bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .latent import LatentShape
from .profiles import Profile


@dataclass(frozen=True)
class Cluster:
    """gpus devices, gpus_per_node of them per node, on `profile`'s hardware (bandwidths may be overridden)."""

    gpus: int
    gpus_per_node: int
    profile: Profile
    intra_bw: float | None = None
    inter_bw: float | None = None

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    def t_intra(self, nbytes: float) -> float:
        bw = self.intra_bw or self.profile.intra_bw
        return self.profile.intra_latency + nbytes / bw if nbytes else 0.0

    def t_inter(self, nbytes: float) -> float:
        bw = self.inter_bw or self.profile.inter_bw
        return self.profile.inter_latency + nbytes / bw if nbytes else 0.0

    def t_ring_link(self, nbytes: float) -> float:
        """A flat ring's step: the slowest hop, inter-node as soon as the ring spans nodes."""
        return self.t_inter(nbytes) if self.nodes > 1 else self.t_intra(nbytes)


@dataclass(frozen=True)
class Workload:
    seq_len: int
    heads: int
    head_dim: int
    kv_heads: int | None = None
    batch: int = 1
    layers: int = 1
    causal: bool = True
    dtype_bytes: int | None = None  # default: the profile's
    layout: str = "zigzag"  # contiguous shards leave causal work unbalanced on ring strategies
    forward_only: bool = False  # a prefill: attention's forward pass alone
    window: int | None = None  # causal layers: the keys each query sees at most (windows.py)
    windowed_share: float = 1.0  # the share of layers with that window; the rest full causal
    gathered: float = 0.0  # numbers per token each layer gathers to every rank, no gradient (sparse.py)
    gathered_with_gradient: float = 0.0  # ... whose gradients return in the backward (DeepSeek-V4's entries)
    entries: float = 0.0  # compressed entries a query attends beside its keys, on average (sparse.py)
    indexer_macs: float = 0.0  # multiply-adds of the indexers' scores per query, on average (sparse.py)
    latent: LatentShape | None = None  # MLA: burst moves the latent, others the expanded heads (latent.py)

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads


@dataclass
class Estimate:
    strategy: str
    compute_s: float = 0.0
    comm_s: float = 0.0  # link time of all transfers, hidden or not
    exposed_comm_s: float = 0.0  # what compute does not hide
    wall_s: float = 0.0
    mem_bytes_per_device: float = 0.0
    inter_node_bytes_per_device: float = 0.0
    intra_node_bytes_per_device: float = 0.0
    fits: bool = True
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def overlap(self) -> float:
        """Share of communication time hidden behind compute (1 when nothing is sent)."""
        return 1.0 if self.comm_s == 0 else max(0.0, 1.0 - self.exposed_comm_s / self.comm_s)

    def row(self) -> dict:
        return {
            "strategy": self.strategy,
            "fits": self.fits,
            "wall_s": self.wall_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "overlap": self.overlap,
            "mem_bytes_per_device": self.mem_bytes_per_device,
            "inter_node_bytes_per_device": self.inter_node_bytes_per_device,
            "intra_node_bytes_per_device": self.intra_node_bytes_per_device,
            "note": self.note,
            "step_s": self.extra.get("step_s", self.wall_s),
            "tokens_per_s_per_device": self.extra.get("tokens_per_s_per_device"),
            "scope": self.extra.get("scope", "attention only"),
        }


def ring_pass(cluster: Cluster, steps: int, compute: float, block: float, double: bool, tail: float = 0.0):
    """(wall, link time, exposed, inter bytes, intra bytes) of `steps` double-buffered ring steps,
    each computing `compute` seconds while `block` bytes move to the next device; `tail` bytes take
    one more hop at the end (a gradient going home)."""
    c = compute / steps
    g, L, nodes = cluster.gpus, cluster.gpus_per_node, cluster.nodes
    hops = steps - 1
    if g == 1:
        return compute, 0.0, 0.0, 0.0, 0.0
    if double and nodes > 1:
        # Each inter-node step hides behind a whole intra-node sub-ring (L steps of compute and of
        # intra transfers, which use their own link): burstengine.md Table 1, Fig. 5.
        t_intra, t_inter = cluster.t_intra(block), cluster.t_inter(block)
        inter_hops = round(hops * (nodes - 1) / (g - 1)) if hops else 0
        intra_hops = hops - inter_hops
        outer = max(1, math.ceil(steps / L))
        per_outer = max(L * max(c, t_intra), t_inter)
        wall = c + max(0, outer - 1) * per_outer + max(0, L - 1) * max(c, t_intra)
        wall = max(wall, compute)
        link = intra_hops * t_intra + inter_hops * t_inter
        inter_bytes, intra_bytes = inter_hops * block, intra_hops * block
    else:
        t = cluster.t_ring_link(block)
        wall = c + hops * max(c, t)
        link = hops * t
        spans = nodes > 1
        inter_bytes, intra_bytes = (hops * block, 0.0) if spans else (0.0, hops * block)
    if tail:
        t_tail = cluster.t_ring_link(tail)
        wall += t_tail
        link += t_tail
        if nodes > 1:
            inter_bytes += tail
        else:
            intra_bytes += tail
    return wall, link, max(0.0, wall - compute), inter_bytes, intra_bytes


def collective_time(cluster: Cluster, nbytes: float, share_inter: float) -> tuple[float, float, float]:
    """(time, inter bytes, intra bytes) of a collective sending `nbytes` from this device, a share of
    which crosses nodes; intra and inter links run at once."""
    if nbytes == 0:
        return 0.0, 0.0, 0.0
    inter, intra = nbytes * share_inter, nbytes * (1 - share_inter)
    t = max(cluster.t_inter(inter) if inter else 0.0, cluster.t_intra(intra) if intra else 0.0)
    return t, inter, intra
