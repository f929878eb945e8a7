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
        shape = Workload(workload.seq_len, m.heads, m.head_dim, m.kv_heads, workload.batch, m.layers,
                         workload.causal, workload.dtype_bytes, workload.layout)
        sp = replace(cluster, gpus=cluster.gpus // workload.dp,
                     gpus_per_node=min(cluster.gpus // workload.dp, cluster.gpus_per_node))
        rows = [_mark_refusal(whole_model(s, cluster, workload, memory_bytes), sp, shape)
                for s in (strategies or STRATEGIES)]
    else:
        rows = [_mark_refusal(attention_step(s, cluster, workload), cluster, workload)
                for s in (strategies or STRATEGIES)]
    return sorted(rows, key=lambda e: (not e.fits, e.wall_s))


def _mark_refusal(est: Estimate, cluster: Cluster, w: Workload) -> Estimate:
    name = est.strategy.replace("-double-ring", "")
    why = refusal(name, cluster.gpus, w.seq_len, w.heads, w.kv_heads, w.head_dim, w.layout, w.causal)
    if why is not None:
        est.fits = False
        est.note = "burst.attention refuses: " + why.split(";")[0]
    return est


def choose(cluster: Cluster, workload: Workload, candidates) -> str:
    """The fastest of `candidates` (burst.attention strategy names) that fits; the double ring is
    what "burst" and "ring" run on a multi-node topology, so it is costed under their names."""
    costed = {}
    for name in candidates:
        modelled = f"{name}-double-ring" if name in ("burst", "ring") and cluster.nodes > 1 else name
        if modelled in STRATEGIES:
            costed[name] = attention_step(modelled, cluster, workload)
    if not costed:
        raise ValueError(f"no modelled strategy among {tuple(candidates)}")
    return min(costed, key=lambda n: (not costed[n].fits, costed[n].wall_s, n))


def device_profile(device) -> Profile:
    """The profile for tensors on `device`: `local` on CPU, the matching GPU by name on CUDA (H100
    when the name is not one we profile)."""
    import torch

    if device.type != "cuda":
        return profile("local")
    name = torch.cuda.get_device_name(device)
    for known in ("H200", "H100", "A800", "A100"):
        if known in name:
            return profile(known)
    return profile("H100")


def auto_choice(candidates, call, q, k) -> str:
    """strategy="auto": the planner's choice among `candidates` for this call's shapes and group.

    Costed by model_cost.attention_step: attention alone (the call knows no model) under the same
    contention and per-layer synchronisation as `burst plan --model`. Nodes come from the call's
    topology when it has one, else LOCAL_WORLD_SIZE (torchrun), else one node. Every input is the
    same on every rank of an SPMD program; the agreement check catches the rest.
    """
    import os

    if not candidates:
        raise ValueError("strategy='auto': no strategy takes this combination of layout, mask and options")
    topology = getattr(call, "topology", None)
    per_node = getattr(topology, "local_world_size", None) or int(os.environ.get("LOCAL_WORLD_SIZE", call.world))
    per_node = per_node if per_node > 0 and call.world % per_node == 0 else call.world
    cluster = Cluster(gpus=call.world, gpus_per_node=per_node, profile=device_profile(q.device))
    workload = Workload(seq_len=call.local_len * call.world, heads=q.shape[2], head_dim=q.shape[3],
                        kv_heads=k.shape[2], batch=q.shape[0], causal=call.spec.causal,
                        dtype_bytes=q.element_size(), layout=call.layout)
    return choose(cluster, workload, candidates)


__all__ = ["Training", "whole_model", "attention_step", "model_config", "model_presets", "check_call", "check_split",
           "refusal", "auto_choice", "device_profile", "plan", "choose", "estimate",
           "Cluster", "Workload", "Estimate", "Profile", "PROFILES", "profile", "STRATEGIES"]
