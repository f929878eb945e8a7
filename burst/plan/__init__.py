"""burst.plan: which strategy for this cluster and workload, and what it will cost.

    from burst.plan import Cluster, Workload, plan, profile
    rows = plan(Cluster(gpus=32, gpus_per_node=8, profile=profile("A800")),
                Workload(seq_len=1 << 20, heads=40, head_dim=128, layers=40, causal=True))
    rows[0].strategy, rows[0].wall_s, rows[0].fits

    # the whole model: a training step of BurstEngine's 14B (FSDP, checkpointing, LM head, optimizer)
    rows = plan(Cluster(32, 8, profile("A800")), Training(model_config("llama-14b"), 1 << 20, checkpointing="remat"))
    rows[0].extra["step_s"], rows[0].extra["tokens_per_s_per_device"], rows[0].mem_bytes_per_device

Estimates come from an analytic model (cost.py: attention's compute, bytes per link, overlap,
memory per device; model_cost.py: the whole model's step, FSDP, checkpointing and memory, with
the contention and synchronisation that keep overlap from being perfect) with hardware profiles
(profiles.py: A100, A800, H100, H200, and `local`, calibrated by `burst bench --calibrate`).
papers.py holds the papers' own formulas the model is tested against; paper_runs.py their measured
GPU runs (benchmarks/planner_vs_papers.md compares them with the plan).
"""

from __future__ import annotations

from dataclasses import replace

from ..strategies import split_variant
from .auto import auto_choice, choose, device_profile
from .cost import STRATEGIES, Cluster, Estimate, Workload, estimate
from .model_cost import Training, attention_step, model_config, model_presets, whole_model
from .profiles import PROFILES, Profile, profile
from .takes import check_call, check_split, refusal


def plan(cluster: Cluster, workload, strategies=None, memory_bytes=None) -> list[Estimate]:
    """Every modelled strategy's estimate, fitting ones first, fastest first. `workload` is a
    Workload (attention alone) or a Training (the whole model: model_cost.whole_model). A strategy
    that burst.attention would refuse for this workload (distflash on a zigzag layout, ulysses on
    heads that do not split) does not fit, and its note says why."""
    if isinstance(workload, Training):
        m = workload.model
        shape = Workload(
            workload.seq_len,
            m.heads,
            m.head_dim,
            m.kv_heads,
            workload.batch,
            m.layers,
            workload.causal,
            workload.dtype_bytes,
            workload.layout,
        )
        sp = replace(
            cluster,
            gpus=cluster.gpus // workload.dp,
            gpus_per_node=min(cluster.gpus // workload.dp, cluster.gpus_per_node),
        )
        rows = [
            _mark_refusal(whole_model(s, cluster, workload, memory_bytes), sp, shape)
            for s in (strategies or STRATEGIES)
        ]
    else:
        rows = [
            _mark_refusal(attention_step(s, cluster, workload), cluster, workload) for s in (strategies or STRATEGIES)
        ]
    return sorted(rows, key=lambda e: (not e.fits, e.wall_s))


def _mark_refusal(est: Estimate, cluster: Cluster, w: Workload) -> Estimate:
    name = split_variant(est.strategy)[0]
    why = refusal(name, cluster.gpus, w.seq_len, w.heads, w.kv_heads, w.head_dim, w.layout, w.causal, w.window)
    if why is not None:
        est.fits = False
        est.note = "burst.attention refuses: " + why.split(";")[0]
    return est


__all__ = [
    "Training",
    "whole_model",
    "attention_step",
    "model_config",
    "model_presets",
    "check_call",
    "check_split",
    "refusal",
    "auto_choice",
    "device_profile",
    "plan",
    "choose",
    "estimate",
    "Cluster",
    "Workload",
    "Estimate",
    "Profile",
    "PROFILES",
    "profile",
    "STRATEGIES",
]
