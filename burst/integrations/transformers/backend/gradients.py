"""Gradients on burst's backend: each rank's backward gives its tokens' share of the global mean
loss's gradient; reduce_gradients sums the shares over the sequence-parallel group, and fully_shard
applies FSDP2 with the divide factor that makes FSDP's own reduce-scatter do it (fsdp_reduction: the
one rule for them and for DDP's average, which ddp_step_problem holds shard_batch's DDP model to).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from burst.comm.collectives import all_reduce_in_place
from burst.comm.membership import group_ranks, is_dtensor
from burst.layout import DOCUMENT_LAYOUTS

from .checks import check_model
from .features import prepare_features
from .registry import backend_of, registered_group, unwrap_model


def reduce_gradients(model: torch.nn.Module, group=None) -> None:
    """Make every parameter gradient the single-process one, once per step after backward.

    Each rank's gradient holds its tokens' share of the global mean loss, so the shares are summed
    over the sequence-parallel `group` (under DDP as well: its average over ranks that include the
    group leaves each 1/|group|, and this sum makes it whole; shard_batch refuses a DDP step taken
    without it). Parameters managed by FSDP2 (`fully_shard`, ours below or
    torch's) were already reduce-scattered over FSDP's mesh during backward; FSDP *averages* there
    by default, which left alone makes every gradient 1/G of the true one. Their shards are scaled
    to the sum over the group (a mean over the mesh's other, data-parallel ranks) and, when FSDP's
    mesh does not contain the group, summed over the group as well.

    group: default, the group the model's attention was registered with (`register(group=...)`); another one
    is refused (a dp x sp world's default group would sum the replicas too). A DDP or torch.compile wrapper
    is seen through.
    """
    model, _ = unwrap_model(model)
    check_model(model)
    group = registered_group(model, group, "reduce_gradients")
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    _watch(model)
    for p in model.parameters():
        p._burst_unsummed = None
    summed = _parameters_to_sum(model, group)
    all_reduce_in_place([p.grad for p in summed], group=group)
    for p in summed:  # what a later backward must not add into (_added_to_summed)
        p._burst_summed = _SummedGradient(p.grad)
    sharded: dict[tuple, list] = {}
    for unit, g in _grads_by_unit(model):
        key = (_mesh_ranks(g.device_mesh), _divide_factor(unit, g.device_mesh))
        sharded.setdefault(key, []).append(g.to_local())
    for (fsdp_ranks, factor), local in sharded.items():
        scale, sum_over_group = fsdp_reduction(fsdp_ranks, group_ranks(group), factor)
        if scale != 1:
            torch._foreach_mul_(local, scale)
        if sum_over_group:
            all_reduce_in_place(local, group=group)


def fully_shard(model: torch.nn.Module, mesh=None, group=None, **fsdp_kwargs) -> torch.nn.Module:
    """FSDP2 for a model on burst's backend: each decoder layer (the model's `_no_split_modules`)
    and the root, over `mesh` (default: a 1-D mesh over the world), with the gradient divide factor
    that makes FSDP's reduce-scatter give the single-process gradients (summed over the sequence-
    parallel `group`, averaged over data-parallel ranks); sum-only collectives, as gloo needs.
    `reduce_gradients(model)` after backward then does only what FSDP's reduction cannot (nothing
    when the mesh contains the group). fsdp_kwargs go to torch's fully_shard (mp_policy, ...).
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    _, backend = backend_of(model)
    if backend.layout not in DOCUMENT_LAYOUTS:  # those are cut per batch: shard_batch prepares them
        prepare_features(model, backend.group, backend.layout)  # before FSDP wraps the layers a hybrid hooks
    check_model(model)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard takes a 1-D mesh (got {mesh.ndim}-D): pass mesh['dp'] or a "
            "flattened mesh; hybrid sharding is not supported by the backend yet"
        )
    scale, _ = fsdp_reduction(_mesh_ranks(mesh), group_ranks(group), 1.0)
    factor = 1.0 / scale  # the factor for which reduce_gradients' scale is 1
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in layer_names] + [model]
    for unit in units:
        torch_fully_shard(unit, mesh=mesh, **fsdp_kwargs)
        unit.set_gradient_divide_factor(factor)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):  # torch >= 2.7; gloo has no PREMUL_SUM
            unit.set_force_sum_reduction_for_comms(True)
        unit._burst_divide_factor = factor
    return model


def fsdp_reduction(
    fsdp_ranks: tuple[int, ...], group_ranks: tuple[int, ...], factor: float, reducer: str = "FSDP's mesh"
) -> tuple[float, bool]:
    """(scale, sum_over_group) that turn FSDP's reduce-scatter over `fsdp_ranks` (the sum divided by
    `factor`) into the single-process gradient: summed over the sequence-parallel `group_ranks`,
    averaged over the data-parallel replicas. One rule for fully_shard, reduce_gradients and DDP
    (ddp_step_problem; `reducer` names what averages in the error).

    The group inside the mesh: the mesh holds |mesh| / |group| replicas, so scale = factor |group| /
    |mesh|. The group across the mesh (FSDP over data-parallel ranks only): scale = factor / |mesh|,
    then a sum over the group.
    """
    mesh, sp = set(fsdp_ranks), set(group_ranks)
    if sp <= mesh:
        return factor * len(sp) / len(mesh), False
    if len(mesh & sp) == 1:
        return factor / len(mesh), True
    raise NotImplementedError(
        f"{reducer} (ranks {sorted(mesh)}) and burst's sequence-parallel group (ranks "
        f"{sorted(sp)}) overlap in part: shard over the group's ranks, every rank, or "
        "one rank of each group (data parallel)"
    )


def _parameters_to_sum(model: torch.nn.Module, group) -> list[torch.nn.Parameter]:
    """The plain (not FSDP-managed) parameters whose gradients to sum, the same list on every rank: a parameter that got
    a gradient on some rank only (an MoE expert no token of another rank's shard was routed to) gets
    zeros where it has none, as one process would give it the sum; one no rank used stays None. One
    small all-reduce of which parameters have gradients, so every rank's flattened all-reduce matches, and of
    whether a backward added into gradients already summed (ValueError on every rank)."""
    plain = [p for p in model.parameters() if p.requires_grad and not is_dtensor(p) and not is_dtensor(p.grad)]
    if not plain:
        return []
    added = float(any(getattr(p, "_burst_added_into", False) for p in plain))
    used = torch.tensor([float(p.grad is not None) for p in plain] + [added], device=plain[0].device)
    dist.all_reduce(used, group=group)
    if used[-1] > 0:  # on every rank: one rank's accumulation is every rank's
        for p in plain:
            p._burst_added_into = False
        raise ValueError(
            "reduce_gradients: a backward added into gradients it had already summed over the ranks (called after "
            "each micro-batch of a gradient accumulation?): the sum would count the earlier micro-batches once per "
            "rank. Call it once per optimizer step, after the last micro-batch's backward"
        )
    for p, ranks in zip(plain, used[:-1].tolist()):
        if ranks and p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p for p in plain if p.grad is not None]


def _watch(model: torch.nn.Module) -> None:
    """Once per model: a hook after each parameter's gradient accumulates (_added_to_summed)."""
    if getattr(model, "_burst_gradients_watched", False):
        return
    for p in model.parameters():
        if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
            p.register_post_accumulate_grad_hook(_added_to_summed)
    model._burst_gradients_watched = True


def _added_to_summed(param: torch.Tensor) -> None:
    """A parameter's `_burst_summed` is (the gradient reduce_gradients summed, its version then); a backward that
    added into that very gradient without a zero_() between (its version one more) marks `_burst_added_into`: a
    second sum would count the first part once per rank. set_to_none and zero_() leave nothing to mark. Every
    accumulation marks `_burst_unsummed` with the parameter's version until reduce_gradients (ddp_step_problem
    reads it: an optimizer step moves the version)."""
    param._burst_unsummed = param._version
    found = getattr(param, "_burst_summed", None)
    if found is not None and param.grad is found.grad() and param.grad._version == found.version + 1:
        param._burst_added_into = True


class _SummedGradient:
    """The gradient reduce_gradients summed (a weak reference) and its version then. Pickled as nothing (torch.save
    of a whole model: a weak reference does not pickle, and a loaded model holds no summed gradient)."""

    __slots__ = ("grad", "version")

    def __init__(self, grad: torch.Tensor):
        self.grad, self.version = weakref.ref(grad), grad._version

    def __reduce__(self):
        return (type(None), ())


def ddp_step_problem(ddp: torch.nn.parallel.DistributedDataParallel, group=None) -> Exception | None:
    """What is wrong with the last step of a DDP-wrapped model, for shard_batch to raise on every rank (None: nothing
    seen). DDP *averages* over its ranks; where they include the sequence-parallel `group`, each rank's share of the
    loss comes out 1/|group| of the whole gradient, with the weights still equal on every rank (the weights check
    cannot see it): reduce_gradients' sum over the group is what makes it one process's (fsdp_reduction's rule; a
    partial overlap is refused). ValueError when a backward left gradients that reduce_gradients never summed and
    the parameter moved or lost its gradient since (an optimizer step, zero_grad; gradients zeroed in place
    are seen by the step that moves the parameters, a step taken after this batch was sharded at the next).
    A loop that scales its loss for DDP's average passes the model out of its wrapper, `model=ddp.module`
    (SequenceParallel's model is marked `_burst_loss_scaled` and not looked at)."""
    if not dist.is_initialized():
        return None
    ddp_ranks, sp_ranks = tuple(dist.get_process_group_ranks(ddp.process_group)), group_ranks(group)
    try:
        _, sums_over_group = fsdp_reduction(ddp_ranks, sp_ranks, 1.0, reducer="DDP's process group")
    except NotImplementedError as err:
        return err
    if sums_over_group or len(sp_ranks) == 1:  # DDP over data-parallel ranks: the weights check sees a miss
        return None
    model, _ = unwrap_model(ddp.module)
    if getattr(model, "_burst_loss_scaled", False):  # SequenceParallel's loss, scaled for DDP's average
        return None
    _watch(model)
    if any(_stepped_unsummed(p) for p in model.parameters()):
        return ValueError(
            f"a step was taken on gradients bt.reduce_gradients(model) did not sum: DDP over ranks {list(ddp_ranks)} "
            f"averages the shares of the sequence-parallel ranks {list(sp_ranks)}, which leaves every gradient "
            f"1/{len(sp_ranks)} of one process's. Call bt.reduce_gradients(model) after the backward, before "
            "optimizer.step() (a loop that scales its loss by the group's size for DDP instead passes "
            "model=ddp.module to shard_batch)"
        )
    return None


def averaging_group(model: torch.nn.Module, ddp, group):
    """The process group over which the gradients of `model` are averaged across data-parallel replicas: DDP's
    (`ddp`, the wrapper or None), else the mesh of its FSDP-managed parameters; None where it holds no rank outside
    the sequence-parallel `group` (no replicas), or the model's loss is already scaled for the average (marked
    `_burst_loss_scaled`: SequenceParallel's)."""
    if getattr(model, "_burst_loss_scaled", False) or not dist.is_initialized():
        return None
    if ddp is not None:
        averaging = ddp.process_group
    else:
        sharded = next((p for p in model.parameters() if is_dtensor(p)), None)
        if sharded is None or sharded.device_mesh.ndim != 1:
            return None
        averaging = sharded.device_mesh.get_group()
    if not set(dist.get_process_group_ranks(averaging)) - set(group_ranks(group)):
        return None
    return averaging


def _stepped_unsummed(p: torch.nn.Parameter) -> bool:
    """Whether `p` moved (an optimizer step: its version) or lost its gradient (zero_grad) since a backward left
    a gradient reduce_gradients did not sum."""
    version = getattr(p, "_burst_unsummed", None)
    return version is not None and (p.grad is None or p._version != version)


def _fsdp_units(model):
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _grads_by_unit(model) -> list[tuple]:
    """(unit, gradient) for each FSDP-managed gradient: the innermost unit holding the parameter
    manages it (model.modules() lists a unit before the units nested in it)."""
    owner = {}
    for unit in _fsdp_units(model):
        for p in unit.parameters():
            owner[id(p)] = (unit, p)
    return [(unit, p.grad) for unit, p in owner.values() if p.grad is not None and is_dtensor(p.grad)]


def _mesh_ranks(mesh) -> tuple[int, ...]:
    if mesh.ndim != 1:
        raise NotImplementedError("reduce_gradients takes FSDP over a 1-D mesh; hybrid sharding is not supported")
    return tuple(dist.get_process_group_ranks(mesh.get_group()))


def _divide_factor(unit, mesh) -> float:
    """The factor FSDP divided this unit's gradients by: ours (fully_shard above), one set by hand
    (read where this PyTorch keeps it), else FSDP's default, the mesh size."""
    ours = getattr(unit, "_burst_divide_factor", None)
    if ours is not None:
        return ours
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    for param_group in groups:
        factor = getattr(param_group, "gradient_divide_factor", None)
        if factor is not None:
            return float(factor)
    return float(mesh.size())
