"""Sequence parallelism for data pipelines built on accelerate: the pieces SequenceParallelTrainer is
made of, and `SequenceParallel`, the same for a hand-written accelerate loop.

    from accelerate import Accelerator
    from burst.integrations.transformers import SequenceParallel

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sp = SequenceParallel(model, sp_size=2, layout="zigzag")   # groups; burst attention; hybrids hooked
    loader = sp.dataloader(loader)                            # a group's ranks get the same batches
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(sp.loss(model, batch))       # this rank's shard; the world's token mean
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); optimizer.zero_grad()

Under `torchrun --nproc-per-node W` the world is dp x sp processes, each group `sp_size` consecutive
ranks. The update equals one process running the same loop on the replicas' rows together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from burst import layout as layout_mod
from burst.comm.membership import group_size

from .backend.attention import register
from .backend.batches import shard_batch
from .backend.registry import unwrap_model
from .backend.checks import check_model
from .backend.features import prepare_features
from .fused_loss import check_fusable, fused_causal_lm_loss
from .layers.router_loss import REAL_TOKENS, count_rows


class SequenceParallel:
    """A hand-written accelerate loop, each sequence split over `sp_size` ranks by burst.

    model: the (prepared) transformers model; it is switched to burst's attention (`attn_name`,
    registered with strategy, layout and attention_options) and its recurrent layers are hooked.
    sp_size: ranks per sequence (default: the world). Same rules for the batches as
    SequenceParallelTrainer: right padding with labels -100 there, or packed rows; left padding raises.
    fused_loss: `loss` from the final hidden states and the LM head a tile at a time, never the logits
    (fused_loss.py).
    """

    def __init__(
        self,
        model,
        sp_size: int | None = None,
        strategy: str = "burst",
        layout: str = "zigzag",
        attn_name: str = "burst",
        attention_options: dict | None = None,
        fused_loss: bool = False,
    ):
        self.group, self.sp_size, self.replica, self.replicas = sequence_parallel_groups(sp_size)
        self.layout = layout
        self.world = group_size()
        self.model = getattr(model, "module", model)  # under DDP's wrapper
        self.fused_loss = fused_loss
        if fused_loss:
            check_fusable(self.model)
        prepare_model(
            self.model,
            self.group,
            strategy,
            layout,
            attn_name,  # DDP's wrapper
            attention_options,
        )

    def dataloader(self, loader):
        """`loader` (prepared by accelerate) sampling over the data-parallel replicas only."""
        return over_replicas(loader, self.replica, self.replicas, self.sp_size)

    def shard(self, batch: dict) -> dict:
        """This rank's shard of `batch` (whole sequences, the same on every rank of the group), with
        `num_items_in_batch` the labelled tokens of the whole world's batch (one all-reduce)."""
        shard, _ = shard_whole_sequences(batch, self.model, self.group, self.layout, self.sp_size)
        if "num_items_in_batch" in shard and self.world > 1:
            count = torch.tensor(float(shard["num_items_in_batch"]), device=shard["input_ids"].device)
            dist.all_reduce(count)  # every rank of a group counted its group's rows: sp_size times over
            shard["num_items_in_batch"] = int(round(count.item() / self.sp_size))
        return shard

    def loss(self, model, batch: dict) -> torch.Tensor:
        """The loss to backpropagate for `batch`: this rank's labelled tokens' share of the world's mean
        token loss, times the world size, since DDP (or FSDP) averages gradients over every rank."""
        shard = self.shard(batch)
        loss = fused_causal_lm_loss(model, shard) if self.fused_loss else model(**shard).loss
        return loss * self.world

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The world's mean token loss from what `loss` returned (for logging; a collective)."""
        total = loss.detach().clone()
        if self.world > 1:
            dist.all_reduce(total)
        return total / self.world


def prepare_model(model, group, strategy: str, layout: str, attn_name: str, attention_options: dict | None) -> None:
    """`model` on burst's attention (`attn_name` registered with the strategy, layout, group and
    options), the layers each model feature takes over prepared for `group` (features.py), then checked."""
    register(attn_name, strategy=strategy, layout=layout, group=group, **(attention_options or {}))
    model.set_attn_implementation(attn_name)
    prepare_features(model, group, layout)
    check_model(model)


def shard_whole_sequences(batch: dict, model, group, layout: str, sp_size: int) -> tuple[dict, int]:
    """(this rank's shard of a collator's batch for `model`, the batch's length before padding):
    whole_sequences, then shard_batch (given the model out of DDP's wrapper: the loss is scaled for DDP's average
    here, so no reduce_gradients is owed)."""
    whole, length = whole_sequences(batch, layout_multiple(layout, sp_size))
    inner, _ = unwrap_model(model)
    inner._burst_loss_scaled = True  # trained on a loss scaled for DDP's average: shard_batch asks no sum of it
    shard = shard_batch(whole, group=group, layout=layout, model=inner)
    count_rows(inner, shard.pop(REAL_TOKENS), shard["input_ids"])  # a MoE's router loss
    return shard, length


def over_replicas(dataloader, replica: int, replicas: int, sp_size: int):
    """accelerate shards `dataloader` over every process; make it shard over the replicas."""
    if sp_size == 1:
        return dataloader
    shard = accelerate_shard(dataloader)
    if shard is None:
        raise NotImplementedError(
            f"{type(dataloader).__name__}: burst re-points accelerate's per-process sampler (BatchSamplerShard or "
            f"IterableDatasetShard) to the data-parallel replicas, and this dataloader has none: {_why_unsharded()}"
        )
    shard.num_processes, shard.process_index = replicas, replica
    if replicas == 1 and hasattr(shard, "even_batches"):
        # accelerate would not shard one process at all: no last batch filled up from the start
        shard.even_batches = False
    return dataloader


def _why_unsharded() -> str:
    """Why accelerate left a dataloader without its per-process sampler, for the refusal."""
    from accelerate.state import PartialState

    processes, world = PartialState().num_processes, dist.get_world_size()
    if processes != world:
        return (
            f"accelerate runs this process as a world of {processes} while the process group has {world}: "
            "on a machine without a GPU, pass Accelerator(cpu=True)"
        )
    return "an iterable dataset dispatched from rank 0? Set accelerator_config={'dispatch_batches': False}"


def sequence_parallel_groups(sp_size: int | None):
    """(this rank's group, sp_size, replica index, replica count); groups of consecutive ranks,
    made on every rank (new_group is collective)."""
    world = group_size()
    sp_size = world if sp_size is None else sp_size
    if sp_size < 1 or world % sp_size:
        raise ValueError(f"sp_size={sp_size} must be a positive divisor of the world size {world}")
    if world == 1:
        return None, 1, 0, 1
    rank = dist.get_rank()
    if sp_size == world:
        return dist.group.WORLD, sp_size, 0, 1
    mine = None
    for start in range(0, world, sp_size):
        group = dist.new_group(list(range(start, start + sp_size)))
        if start <= rank < start + sp_size:
            mine = group
    return mine, sp_size, rank // sp_size, world // sp_size


def accelerate_shard(dataloader):
    """accelerate's per-process sharding object inside a prepared dataloader, or None; through the batch samplers
    wrapped around it (accelerate's skip_first_batches, to resume mid-epoch, wraps its sampler in another)."""
    for candidate in (getattr(dataloader, name, None) for name in ("batch_sampler", "sampler", "dataset")):
        while candidate is not None and not _is_accelerate_shard(candidate):
            candidate = getattr(candidate, "batch_sampler", None)
        if candidate is not None:
            return candidate
    return None


def _is_accelerate_shard(candidate) -> bool:
    return hasattr(candidate, "num_processes") and hasattr(candidate, "process_index")


def layout_multiple(layout: str, world: int) -> int:
    """What the sequence length must be a multiple of for `layout` over `world` ranks."""
    if layout in layout_mod.DOCUMENT_LAYOUTS:  # each document cut on its own: the batch's business
        return 1
    return layout_mod.local_multiple(layout) * world


def whole_sequences(batch: dict, multiple: int, ignore_index: int = -100) -> tuple[dict, int]:
    """(batch ready for shard_batch, its length before padding): right padding (attention_mask ones
    then zeros in each row, as Trainer's collators pad, labels `ignore_index` there) is dropped from
    the mask, which is exact for a causal model (no real token sees a later one); the length is
    padded at the end to a multiple of `multiple` the same way. Left padding, holes and labels on
    padded positions raise (the model would score tokens whose logits one process computes otherwise).
    The batch gains REAL_TOKENS, (batch, padded) bool, the tokens one process runs: a MoE's router loss
    counts those alone (layers/router_loss.py), as transformers' does under the collator's mask."""
    out = dict(batch)
    ids = out["input_ids"]
    length = ids.shape[1]
    mask = out.pop("attention_mask", None)
    if mask is not None:
        keep = mask.bool()
        right_padded = bool((keep.cummin(dim=1).values == keep).all())
        if not right_padded:
            raise ValueError(
                "attention_mask has zeros before ones (left padding or holes): burst runs whole "
                "sequences; pad on the right (tokenizer.padding_side = 'right') or pack documents"
            )
        for name in ("labels", "shift_labels"):
            targets = out.get(name)
            if targets is not None and bool((targets[~keep] != ignore_index).any()):
                raise ValueError(
                    f"{name} at padded positions (attention_mask 0) must be {ignore_index}, as "
                    "DataCollatorForLanguageModeling makes them"
                )
    pad = -length % multiple
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    out[REAL_TOKENS] = torch.nn.functional.pad(real, (0, pad), value=False)
    if pad:
        positions = out.get("position_ids")
        for name, value in list(out.items()):  # every entry along the tokens: a collator's shift_labels too
            if name != "position_ids" and isinstance(value, torch.Tensor) and value.shape[:2] == ids.shape:
                fill = ignore_index if name in ("labels", "shift_labels") else 0
                out[name] = torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, pad), value=fill)
        if positions is not None:  # the padding continues the last document
            tail = positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)
            out["position_ids"] = torch.cat([positions, tail], dim=1)
    return out, length
