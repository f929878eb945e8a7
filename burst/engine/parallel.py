"""Data parallel x sequence parallel for the engine: the 2-D DeviceMesh, FSDP2, gradient reduction.

The world is a (dp, sp) mesh (torchtitan's habit): ranks of one "sp" row split each sequence
(burst.attention runs over that row's group); the dp rows see different sequences. Parameters are
either replicated, or sharded with FSDP2 (`fully_shard`) over the dp dimension ("dp") or over every
rank of the world ("mesh": the most memory saved, BurstEngine's FSDP over all devices).

Gradients: a rank's gradient holds its tokens' share of its replica's mean loss, so the sp ranks'
gradients are *summed* and the dp replicas' *averaged*, once per step:
    fsdp none   one all-reduce (sum) over the world, then / dp
    fsdp dp     FSDP's reduce-scatter averages over dp; one all-reduce (sum) of the shards over sp
    fsdp mesh   FSDP's reduce-scatter over the world with divide factor dp (sum over sp, mean over dp)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_in_place
from ..comm.membership import group_size, is_dtensor
from ..plan.models import check_dp

FSDP_MODES = ("none", "dp", "mesh")


@dataclass
class Parallel:
    """Where this rank sits: dp x sp ranks, its coordinates, and the groups it talks on."""

    dp: int = 1
    sp: int = 1
    dp_rank: int = 0
    sp_rank: int = 0
    sp_group: dist.ProcessGroup | None = None  # None = the default group (when dp == 1)
    fsdp: str = "none"
    mesh: object | None = None  # DeviceMesh (dp, sp) when dp > 1 or FSDP is on

    @property
    def world(self) -> int:
        return self.dp * self.sp

    @property
    def loss_group(self):
        """The group the fused loss takes its global token count over (None on one sp rank)."""
        return (self.sp_group or dist.group.WORLD) if self.sp > 1 else None


def setup(dp: int, fsdp: str = "none", device: str = "cpu") -> Parallel:
    """This rank's Parallel for the initialized world split into dp replicas of world / dp ranks."""
    world = group_size()
    check_dp(dp, world)
    sp = world // dp
    if dp == 1 and fsdp == "none":  # (dp > 1 needs the mesh's groups even without FSDP)
        return Parallel() if world == 1 else Parallel(sp=sp, sp_rank=dist.get_rank())
    if not dist.is_initialized():  # FSDP2 shards over a device mesh, which needs a process group
        raise ValueError(f"--fsdp {fsdp}: FSDP2 needs an initialized process group (burst.launch starts one)")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp"))
    return Parallel(
        dp=dp,
        sp=sp,
        dp_rank=mesh.get_local_rank("dp"),
        sp_rank=mesh.get_local_rank("sp"),
        sp_group=mesh.get_group("sp"),
        fsdp=fsdp,
        mesh=mesh,
    )


def check_sharding(fsdp: str, cpu_offload: bool) -> None:
    """Raise ValueError for an FSDP mode or CPU offload this machine cannot run (shard_parameters and
    `burst train` before it starts)."""
    if fsdp not in FSDP_MODES:
        raise ValueError(f"--fsdp {fsdp!r}: one of {FSDP_MODES}")
    if cpu_offload and fsdp == "none":
        raise ValueError("--cpu-offload needs --fsdp dp or mesh (it is FSDP2's offload policy)")
    if cpu_offload and not torch.cuda.is_available():
        raise ValueError(
            "--cpu-offload needs a CUDA device (FSDP2 pins host memory for the copies; "
            "on a CPU-only machine parameters already live in host memory)"
        )


def shard_parameters(model: torch.nn.Module, par: Parallel, cpu_offload: bool = False) -> torch.nn.Module:
    """FSDP2 over the dp dimension or the whole world (par.fsdp), one unit per decoder layer plus the
    root (embeddings, final norm, LM head); CPU offload of parameters, gradients and optimizer state."""
    check_sharding(par.fsdp, cpu_offload)
    if par.fsdp == "none":
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if par.fsdp == "dp":
        mesh = par.mesh["dp"]
    else:  # every rank of the world: a 1-D mesh over (dp x sp)
        mesh = par.mesh._flatten("dp_sp") if hasattr(par.mesh, "_flatten") else par.mesh
    kwargs = {"mesh": mesh}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    units = [*model.blocks, model]
    for unit in units:
        fully_shard(unit, **kwargs)
    if par.fsdp == "mesh":
        for unit in units:
            unit.set_gradient_divide_factor(float(par.dp))
            unit.set_force_sum_reduction_for_comms(True)  # scale apart: gloo has no PREMUL_SUM
    return model


def reduce_gradients(model: torch.nn.Module, par: Parallel) -> None:
    """Make every rank's gradients the global batch's (see the module docstring), once per step."""
    if par.world == 1 or par.fsdp == "mesh" or (par.fsdp == "dp" and par.sp == 1):
        return  # FSDP's reduce-scatter did all of it
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if is_dtensor(g) else g for g in grads]  # FSDP2's shards are DTensors
    if par.fsdp == "dp":
        all_reduce_in_place(local, group=par.sp_group)
    else:
        all_reduce_in_place(local, divide_by=par.dp)
