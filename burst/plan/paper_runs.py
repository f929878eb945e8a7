"""The papers' GPU measurements the planner can express, as data (benchmarks/planner_vs_papers.py
turns them into benchmarks/planner_vs_papers.md; tests/test_plan.py checks a few).

Each Run is one measured figure: the configuration (as `burst plan` flags), the metric and the
paper's value. Readings of each paper's setup, stated once:

- burstengine.md §4.1: nodes of 8 A800-SXM4-80GB, NVLink 400 GB/s bidirectional (200 GB/s per GPU
  per direction: the A800 profile), 8 HDR NICs of 200 Gb/s per node (25 GB/s per GPU: the
  profile's inter-node figure); bf16, batch 1, FSDP over all GPUs. Tables 4 and 5 and the 2M/4M
  runs are the full system of Table 2's last row (double ring with backward optimisation, fused LM
  head, "selective checkpointing++" = our `remat`: attention output kept); Table 5's single node
  offloads the optimizer and runs dp = 8 / CP replicas. Memory is GB as printed; we compare 1e9 bytes.
  Table 2's rows: no backward optimisation = `ring`, no topology-aware ring = flat ring, no
  selective checkpointing = `full`, "sequence-level selective" = `selective` (split 0.5).
- distflashattn.md §4: DGX A100 80GB boxes (NVLink), two of them over "100 Gbps InfiniBand" read
  as 100 Gb/s per GPU (12.5 GB/s; a DGX A100 has one NIC per GPU); bf16, batch 1, FSDP, contiguous
  shards with DistFlashAttn's balanced schedule; Table 5 "Our ckpt" = `remat`, "HF ckpt" = `full`.
- burstattention.md §4.1: one node of 8 A100 over PCIe: p2p between the 8 GPUs shares the host's
  two x16 root complexes, read as 6 GB/s per GPU per direction; Tables 2-3 are prefills (first-
  token latency), fp16 weights replicated on every GPU (no ZeRO), full attention (no mask).
- ring-attention.md Table 3: full precision (fp32 weights, activations and logits), full
  checkpointing, FSDP, A100 80GB; 8 GPUs on NVLink, 32 over InfiniBand (the A100 profile). The
  table gives the longest context that trained: it fits, twice it does not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    source: str
    label: str
    strategy: str
    gpus: int
    profile: str
    model: str
    seq_len: int
    metric: str                 # tgs (tokens/s/GPU), step_s, prefill_s, mem_gb, fits, speedup, over_1gpu
    value: float
    group: str = ""             # runs whose time the paper compares (orderings)
    gpus_per_node: int = 8
    checkpointing: str = "remat"
    mode: str = "train"
    dp: int = 1
    fused_loss: bool = True
    fsdp: bool = True
    offload_optimizer: bool = False
    causal: bool = True
    layout: str = "zigzag"
    dtype_bytes: int | None = None
    inter_gbps: float | None = None
    intra_gbps: float | None = None
    attention_only: bool = False
    backward_overlap: bool = True  # False: LoongTrain's double ring (no backward overlap)
    counted: bool = True        # False: the same measurement printed again elsewhere, or an order only

    def argv(self) -> list[str]:
        """The `burst plan` flags of this configuration."""
        a = ["--gpus", str(self.gpus), "--gpus-per-node", str(self.gpus_per_node), "--profile", self.profile,
             "--model", self.model, "--seq-len", str(self.seq_len)]
        if self.attention_only:
            a += ["--attention-only"] + (["--mode", "prefill"] if self.mode == "prefill" else [])
        else:
            a += ["--mode", "prefill"] if self.mode == "prefill" else ["--checkpointing", self.checkpointing]
            if self.dp > 1:
                a += ["--dp", str(self.dp)]
            if not self.fused_loss:
                a += ["--unfused-loss"]
            if not self.fsdp:
                a += ["--no-fsdp"]
            if self.offload_optimizer:
                a += ["--offload-optimizer"]
            if not self.backward_overlap:
                a += ["--no-backward-overlap"]
        if self.causal:
            a += ["--causal"]
        if self.layout != "zigzag":
            a += ["--layout", self.layout]
        if self.dtype_bytes:
            a += ["--dtype-bytes", str(self.dtype_bytes)]
        if self.inter_gbps:
            a += ["--inter-node-gbps", f"{self.inter_gbps:g}"]
        if self.intra_gbps:
            a += ["--intra-node-gbps", f"{self.intra_gbps:g}"]
        return a


def _be(label, strategy, gpus, model, seq, metric, value, group="", **kw):
    return Run("burstengine.md", label, strategy, gpus, "A800", model, seq, metric, value, group, **kw)


M = 1 << 20
K = 1 << 10

# burstengine.md Table 2: 14B, 1M tokens, 32 A800 (TGS and memory per row)
_T2 = [("T2 baseline (ring, full ckpt)", "ring:flat", dict(checkpointing="full", fused_loss=False), 83.79, 48.47),
       ("T2 + backward optimisation", "burst:flat", dict(checkpointing="full", fused_loss=False), 87.48, 49.31),
       ("T2 + topology-aware ring", "burst", dict(checkpointing="full", fused_loss=False), 95.06, 48.97),
       ("T2 + fused LM head and loss", "burst", dict(checkpointing="full"), 94.81, 41.45),
       ("T2 + sequence-level selective", "burst", dict(checkpointing="selective"), 108.82, 45.93),
       ("T2 + selective++ (remat)", "burst", dict(checkpointing="remat"), 117.83, 53.91)]

RUNS: list[Run] = []
for label, strategy, kw, tgs, mem in _T2:
    RUNS.append(_be(label, strategy, 32, "llama-14b", M, "tgs", tgs, "BE T2", **kw))
    RUNS.append(_be(label, strategy, 32, "llama-14b", M, "mem_gb", mem, **kw))
# Table 4: 32K tokens per GPU over 2, 4, 8 nodes (14B)
for nodes, tgs, mem in ((2, 223.25, 63.13), (4, 118.36, 53.96), (8, 60.49, 50.96)):
    RUNS.append(_be(f"T4 {nodes} nodes, {nodes * 8 * 32 / 1024:g}M", "burst", 8 * nodes, "llama-14b",
                    nodes * 8 * 32 * K, "tgs", tgs))
    RUNS.append(_be(f"T4 {nodes} nodes, {nodes * 8 * 32 / 1024:g}M", "burst", 8 * nodes, "llama-14b",
                    nodes * 8 * 32 * K, "mem_gb", mem))
# Table 5: one node, CP = 1..8 (dp = 8 / CP), optimizer offloaded
for cp, tgs, mem in ((1, 1201.14, 57.71), (2, 928.24, 55.18), (4, 639.43, 55.58), (8, 393.44, 53.56)):
    for metric, value in (("tgs", tgs), ("mem_gb", mem)):
        RUNS.append(_be(f"T5 CP {cp}, {cp * 32}K", "burst", 8, "llama-14b", cp * 32 * K, metric, value,
                        dp=8 // cp, offload_optimizer=True))
# §4.2: what trained and what ran out of memory (fits: 1 = trained, 0 = out of memory)
for model, gpus, seq in (("llama-7b", 32, 2 * M), ("llama-14b", 32, M), ("llama-7b", 64, 4 * M),
                         ("llama-14b", 64, 2 * M)):
    RUNS.append(_be(f"§4.2 BurstEngine {model} {seq // M}M", "burst", gpus, model, seq, "fits", 1))
for model, seq in (("llama-7b", 2 * M), ("llama-14b", M)):
    RUNS.append(_be(f"§4.2 Megatron-CP {model} {seq // M}M (no FSDP)", "ring:flat", 32, model, seq, "fits", 0,
                    checkpointing="full", fused_loss=False, fsdp=False))
RUNS.append(_be("§4.2 DeepSpeed-Ulysses 14B 1M (40 heads)", "ulysses", 32, "llama-14b", M, "fits", 0,
                checkpointing="full", fused_loss=False))
for model, seq in (("llama-7b", 4 * M), ("llama-14b", 2 * M)):
    for strategy, name in (("usp", "usp"), ("ring", "ring-double-ring")):
        RUNS.append(_be(f"§4.2 LoongTrain {name} {model} {seq // M}M", strategy, 64, model, seq, "fits", 0,
                        checkpointing="full", fused_loss=False, backward_overlap=strategy == "usp"))
# §4.2 / Fig. 12 in words: BurstEngine 1.19x / 1.15x LoongTrain-USP's TGS; USP > DoubleRing > Ulysses (7B)
for model, seq, speedup in (("llama-7b", 2 * M, 1.19), ("llama-14b", M, 1.15)):
    RUNS.append(_be(f"Fig. 12 BurstEngine {model}", "burst", 32, model, seq, "speedup", speedup,
                    f"BE Fig12 {model}"))
    RUNS.append(_be(f"Fig. 12 LoongTrain-USP {model}", "usp", 32, model, seq, "speedup", 1.0, f"BE Fig12 {model}",
                    checkpointing="full", fused_loss=False))
RUNS.append(_be("Fig. 12 LoongTrain-DoubleRing llama-7b (order only)", "ring", 32, "llama-7b", 2 * M,
                "speedup", 0.9, "BE Fig12 order 7B", checkpointing="full", fused_loss=False, backward_overlap=False))
RUNS.append(_be("Fig. 12 DeepSpeed-Ulysses llama-7b (order only)", "ulysses", 32, "llama-7b", 2 * M,
                "speedup", 0.8, "BE Fig12 order 7B", checkpointing="full", fused_loss=False))
RUNS.append(_be("Fig. 12 LoongTrain-USP llama-7b (order only)", "usp", 32, "llama-7b", 2 * M,
                "speedup", 1.0, "BE Fig12 order 7B", checkpointing="full", fused_loss=False))
# §4.3 / Fig. 14, attention alone (14B's attention, 32 A100, 1M): 1.05x USP, 1.33x DoubleRing
for strategy, name, speedup in (("burst", "burst-double-ring", 1.33), ("usp", "usp", 1.33 / 1.05),
                                ("ring", "ring-double-ring", 1.0)):
    RUNS.append(Run("burstengine.md", f"Fig. 14 attention {name}", strategy, 32, "A100", "llama-14b", M,
                    "speedup", speedup, "BE Fig14", attention_only=True))


def _df(label, strategy, gpus, model, seq, metric, value, group="", **kw):
    kw.setdefault("layout", "contiguous")
    kw.setdefault("inter_gbps", 12.5 if gpus > 8 else None)
    return Run("distflashattn.md", label, strategy, gpus, "A100", model, seq, metric, value, group, **kw)


# distflashattn.md Table 1: DistFlashAttn's iteration time (s), 7B / GQA / 33H
_T1 = {(8, 8): (5.98, 5.61, 6.08), (8, 16): (17.26, 16.86, 17.77), (8, 32): (58.46, 57.01, 59.96),
       (16, 8): (12.75, 9.74, 13.12), (16, 16): (30.21, 28.49, 31.33), (16, 32): (106.37, 102.34, 107.76)}
for (gpus, per_gpu), times in _T1.items():
    for model, value in zip(("llama-7b", "llama-7b-gqa", "llama-33h"), times):
        RUNS.append(_df(f"T1 {gpus // 8}x8 {per_gpu}K/GPU {model}", "distflash", gpus, model, gpus * per_gpu * K,
                        "step_s", value, f"DF T1 {gpus}x{per_gpu}K"))
# Table 3: DistFlashAttn at RSA's longest lengths; and it ran > 256K (1 node), > 512K (2 nodes)
RUNS.append(_df("T3 1 node, 32K", "distflash", 8, "llama-7b", 32 * K, "step_s", 2.50))
RUNS.append(_df("T3 2 nodes, 64K", "distflash", 16, "llama-7b", 64 * K, "step_s", 6.85))
RUNS.append(_df("T3 1 node 256K trains", "distflash", 8, "llama-7b", 256 * K, "fits", 1))
RUNS.append(_df("T3 2 nodes 512K trains", "distflash", 16, "llama-7b", 512 * K, "fits", 1))
# Table 4: DeepSpeed-Ulysses, 7B, 2x8, with the standard (HF) full checkpointing: the
# rematerialization-aware one is DistFlashAttn's own (its 33-head runs pad heads: not expressible)
for per_gpu, value, ours in ((16, 37.53, 30.21), (32, 134.09, 106.37)):
    RUNS.append(_df(f"T4 Ulysses 2x8 {per_gpu}K/GPU", "ulysses", 16, "llama-7b", 16 * per_gpu * K, "step_s", value,
                    f"DF T4 {per_gpu}K", layout="zigzag", checkpointing="full"))
    RUNS.append(_df(f"T4 DistFlashAttn 2x8 {per_gpu}K/GPU (= T1)", "distflash", 16, "llama-7b", 16 * per_gpu * K,
                    "step_s", ours, f"DF T4 {per_gpu}K", counted=False))
# Fig. 5 (left) in words: attention forward of LLaMA-7B on 8 A100, 256K tokens, speedup over one
# GPU's FlashAttention: the balanced schedule saturates at 7.5x, the unbalanced (a ring on
# contiguous shards) at 4.5x
RUNS.append(_df("Fig. 5 balanced (DistFlashAttn) forward, 256K", "distflash", 8, "llama-7b", 256 * K, "over_1gpu",
                7.5, "DF Fig5", attention_only=True, mode="prefill"))
RUNS.append(_df("Fig. 5 unbalanced (ring, contiguous) forward, 256K", "ring", 8, "llama-7b", 256 * K, "over_1gpu",
                4.5, "DF Fig5", attention_only=True, mode="prefill"))
# Table 5: HF checkpointing (full) against rematerialization-aware (remat), 8 A100, 7B
for per_gpu, hf, our in ((1, 0.84, 0.84), (2, 1.29, 1.36), (4, 2.64, 2.50), (8, 6.93, 5.98), (16, 21.44, 17.26),
                         (32, 76.38, 58.46)):
    for ckpt, value in (("full", hf), ("remat", our)):
        RUNS.append(_df(f"T5 {ckpt} {per_gpu}K/GPU", "distflash", 8, "llama-7b", 8 * per_gpu * K, "step_s", value,
                        f"DF T5 {per_gpu}K", checkpointing=ckpt, counted=not (ckpt == "remat" and per_gpu >= 8)))

# burstattention.md Tables 2-3: BurstAttention's first-token latency (s), 8 A100 over PCIe
_BA = {"llama-7b": (0.44, 0.84, 1.68, 3.27, 6.49, 16.01, 49.32),
       "llama-13b": (0.69, 1.40, 2.57, 5.08, 9.92, 25.91, 78.80)}
for model, values in _BA.items():
    table = "T2" if model == "llama-7b" else "T3"
    for i, value in enumerate(values):
        seq = 4096 << i
        RUNS.append(Run("burstattention.md", f"{table} {model} {seq // K}K", "burst", 8, "A100", model, seq,
                        "prefill_s", value, mode="prefill", fsdp=False, causal=False, intra_gbps=6))
    RUNS.append(Run("burstattention.md", f"{table} {model} 256K runs", "burst", 8, "A100", model, 256 * K, "fits", 1,
                    mode="prefill", fsdp=False, causal=False, intra_gbps=6))

# ring-attention.md Table 3: longest context that trained on A100 80GB (fp32, full checkpointing)
for gpus, model, longest in ((8, "llama-3b", 512 * K), (8, "llama-7b", 256 * K), (8, "llama-13b", 128 * K),
                             (32, "llama-7b", 4 * M), (32, "llama-13b", 2 * M)):
    for seq, fits in ((longest, 1), (2 * longest, 0)):
        RUNS.append(Run("ring-attention.md", f"T3 {gpus}x A100 {model} {seq // K}K", "ring:flat", gpus, "A100", model,
                        seq, "fits", fits, checkpointing="full", fused_loss=False, dtype_bytes=4))


def planned(run: Run) -> tuple[float, bool]:
    """(the plan's value of run.metric, whether the plan says it fits) for one Run."""
    from . import plan, profile
    from .cost import Cluster, Workload
    from .model_cost import Training, attention_step, model_config

    cluster = Cluster(run.gpus, min(run.gpus, run.gpus_per_node), profile(run.profile),
                      inter_bw=run.inter_gbps * 1e9 if run.inter_gbps else None,
                      intra_bw=run.intra_gbps * 1e9 if run.intra_gbps else None)
    m = model_config(run.model)
    if run.attention_only:
        w = Workload(run.seq_len, m.heads, m.head_dim, m.kv_heads, layers=m.layers, causal=run.causal,
                     dtype_bytes=run.dtype_bytes, layout=run.layout, forward_only=run.mode == "prefill")
        e = attention_step(run.strategy, cluster, w)
        if run.metric == "over_1gpu":
            return attention_step("ring", Cluster(1, 1, cluster.profile), w).wall_s / e.wall_s, e.fits
        return {"speedup": 1 / e.wall_s, "step_s": e.wall_s}.get(run.metric, e.wall_s), e.fits
    t = Training(m, run.seq_len, dp=run.dp, mode=run.mode, checkpointing=run.checkpointing,
                 fused_loss=run.fused_loss, fsdp=run.fsdp, offload_optimizer=run.offload_optimizer, causal=run.causal,
                 layout=run.layout, dtype_bytes=run.dtype_bytes, backward_overlap=run.backward_overlap)
    e = plan(cluster, t, strategies=[run.strategy])[0]  # as `burst plan` ranks it: refusals included
    value = {"tgs": e.extra["tokens_per_s_per_device"], "speedup": e.extra["tokens_per_s_per_device"],
             "step_s": e.wall_s, "prefill_s": e.wall_s, "mem_gb": e.mem_bytes_per_device / 1e9,
             "fits": float(e.fits)}[run.metric]
    return value, e.fits
