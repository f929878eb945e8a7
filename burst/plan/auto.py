"""strategy="auto": the planner's choice for one burst.attention call, from its shapes and group.

burst.attention (api.py) asks auto_choice; so does plan/takes.check_call for the CLI. Costs come from
model_cost.attention_step (attention alone, under the contention and synchronisation of a model step).
"""

from __future__ import annotations

import torch

from ..comm.topology import ranks_per_node
from .cost import STRATEGIES, Cluster, Workload
from .model_cost import attention_step
from .profiles import Profile, profile


def choose(cluster: Cluster, workload: Workload, candidates) -> str:
    """The fastest of `candidates` (burst.attention strategy names) that fits; the planner's names are
    burst.attention's ("burst" and "ring" run the double ring on a multi-node topology, as modelled)."""
    costed = {}
    for name in candidates:
        if name in STRATEGIES:
            costed[name] = attention_step(name, cluster, workload)
    if not costed:
        raise ValueError(f"no modelled strategy among {tuple(candidates)}")
    return min(costed, key=lambda n: (not costed[n].fits, costed[n].wall_s, n))


def device_profile(device) -> Profile:
    """The profile for tensors on `device`: `local` on CPU, the matching GPU by name on CUDA (H100
    when the name is not one we profile)."""
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
    topology (validation resolves it: LOCAL_WORLD_SIZE under torchrun, else one node); the group's
    ranks per node are counted on them (comm.topology.ranks_per_node). Every input is the same on
    every rank of an SPMD program; the agreement check catches the rest. `candidates` is never empty
    (validation._auto_strategy refuses first, saying why).
    """
    per_node = ranks_per_node(call.topology, call.group, call.world)  # the group's own: a mesh's sequence group too
    cluster = Cluster(gpus=call.world, gpus_per_node=per_node, profile=device_profile(q.device))
    window = call.spec.window  # (left, right); a causal window's keys per query: left + 1
    keys = window[0] + 1 if call.spec.causal and window is not None and window[0] >= 0 else None
    workload = Workload(
        seq_len=call.local_len * call.world,
        heads=q.shape[2],
        head_dim=q.shape[3],
        kv_heads=k.shape[2],
        batch=q.shape[0],
        causal=call.spec.causal,
        dtype_bytes=q.element_size(),
        layout=call.layout,
        window=keys,
    )
    return choose(cluster, workload, candidates)
