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

from . import burstengine_runs, distflashattn_runs
from .paper_run import K, M, Run

# The two long tables have a module each; BurstAttention's and RingAttention's few rows are here
RUNS: list[Run] = burstengine_runs.RUNS + distflashattn_runs.RUNS

# burstattention.md Tables 2-3: BurstAttention's first-token latency (s), 8 A100 over PCIe
_BA = {
    "llama-7b": (0.44, 0.84, 1.68, 3.27, 6.49, 16.01, 49.32),
    "llama-13b": (0.69, 1.40, 2.57, 5.08, 9.92, 25.91, 78.80),
}
for model, values in _BA.items():
    table = "T2" if model == "llama-7b" else "T3"
    for i, value in enumerate(values):
        seq = 4096 << i
        RUNS.append(
            Run(
                "burstattention.md",
                f"{table} {model} {seq // K}K",
                "burst",
                8,
                "A100",
                model,
                seq,
                "prefill_s",
                value,
                mode="prefill",
                fsdp=False,
                causal=False,
                intra_gbps=6,
            )
        )
    RUNS.append(
        Run(
            "burstattention.md",
            f"{table} {model} 256K runs",
            "burst",
            8,
            "A100",
            model,
            256 * K,
            "fits",
            1,
            mode="prefill",
            fsdp=False,
            causal=False,
            intra_gbps=6,
        )
    )

# ring-attention.md Table 3: longest context that trained on A100 80GB (fp32, full checkpointing)
for gpus, model, longest in (
    (8, "llama-3b", 512 * K),
    (8, "llama-7b", 256 * K),
    (8, "llama-13b", 128 * K),
    (32, "llama-7b", 4 * M),
    (32, "llama-13b", 2 * M),
):
    for seq, fits in ((longest, 1), (2 * longest, 0)):
        RUNS.append(
            Run(
                "ring-attention.md",
                f"T3 {gpus}x A100 {model} {seq // K}K",
                "ring:flat",
                gpus,
                "A100",
                model,
                seq,
                "fits",
                fits,
                checkpointing="full",
                fused_loss=False,
                dtype_bytes=4,
            )
        )


def planned(run: Run) -> tuple[float, bool]:
    """(the plan's value of run.metric, whether the plan says it fits) for one Run."""
    from . import plan, profile
    from .cost import Cluster, Workload
    from .model_cost import Training, attention_step, model_config

    cluster = Cluster(
        run.gpus,
        min(run.gpus, run.gpus_per_node),
        profile(run.profile),
        inter_bw=run.inter_gbps * 1e9 if run.inter_gbps else None,
        intra_bw=run.intra_gbps * 1e9 if run.intra_gbps else None,
    )
    m = model_config(run.model)
    if run.attention_only:
        w = Workload(
            run.seq_len,
            m.heads,
            m.head_dim,
            m.kv_heads,
            layers=m.layers,
            causal=run.causal,
            dtype_bytes=run.dtype_bytes,
            layout=run.layout,
            forward_only=run.mode == "prefill",
        )
        e = attention_step(run.strategy, cluster, w)
        if run.metric == "over_1gpu":
            return attention_step("ring", Cluster(1, 1, cluster.profile), w).wall_s / e.wall_s, e.fits
        return {"speedup": 1 / e.wall_s, "step_s": e.wall_s}.get(run.metric, e.wall_s), e.fits
    t = Training(
        m,
        run.seq_len,
        dp=run.dp,
        mode=run.mode,
        checkpointing=run.checkpointing,
        fused_loss=run.fused_loss,
        fsdp=run.fsdp,
        offload_optimizer=run.offload_optimizer,
        causal=run.causal,
        layout=run.layout,
        dtype_bytes=run.dtype_bytes,
        backward_overlap=run.backward_overlap,
    )
    e = plan(cluster, t, strategies=[run.strategy])[0]  # as `burst plan` ranks it: refusals included
    value = {
        "tgs": e.extra["tokens_per_s_per_device"],
        "speedup": e.extra["tokens_per_s_per_device"],
        "step_s": e.wall_s,
        "prefill_s": e.wall_s,
        "mem_gb": e.mem_bytes_per_device / 1e9,
        "fits": float(e.fits),
    }[run.metric]
    return value, e.fits
