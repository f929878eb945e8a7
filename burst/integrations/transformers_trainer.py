"""Sequence-parallel training with the transformers `Trainer`: a subclass, no patched internals.

    import burst.integrations.transformers as bt

    trainer = bt.SequenceParallelTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                                         data_collator=..., sp_size=2, strategy="burst", layout="zigzag")
    trainer.train(); trainer.evaluate(); trainer.predict(dataset)

Run it under `torchrun --nproc-per-node W`: W = dp x sp processes, each
sequence-parallel group `sp_size` consecutive ranks. What the subclass changes, each through an
extension point Trainer documents:

* data (`get_*_dataloader`): accelerate's sampler shards the data over the dp replicas only, so the
  ranks of a group receive the same batch (transformers does the same to its own rank-aware
  batch sampler); `shard_batch` checks that they do at every step and raises otherwise.
* inputs (`training_step`, `prediction_step`): each rank keeps its shard of the batch: labels
  shifted on the whole sequence, position ids global, right padding dropped from the mask (its
  labels must be ignored ones), packed rows split as documents, the length padded to what the
  layout needs.
* loss (`get_cp_size`): Trainer already divides its token count by "the devices that share a
  batch" and multiplies the loss by the world size before DDP/FSDP average the gradients. Telling it
  the context-parallel size makes its own arithmetic give the mean over every token of the world,
  through gradient accumulation and clipping, as one process computes it.
* evaluation (`gather_function`): losses and predictions are gathered over the replicas only, one
  copy per group, and predictions are whole sequences (unsharded within the group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import Trainer

from .. import layout as layout_mod
from .hf_mixers import shard_mixers
from .transformers import check_model, register, reduce_loss, shard_batch


class SequenceParallelTrainer(Trainer):
    """`transformers.Trainer` whose every sequence is split over `sp_size` ranks by burst.

    sp_size: ranks per sequence (default: the world; W must be a multiple); the world's ranks
    r = replica * sp_size + s form the groups. strategy, layout and attention_options (a dict of
    further keywords): as for `bt.register` (`burst.attention`). attn_name: the attention
    implementation name the model is switched to. Everything else is Trainer's. What it cannot
    do exactly raises in __init__: label smoothing, a `compute_loss_func`, a model whose forward
    takes no `num_items_in_batch`, `average_tokens_across_devices=False`, `model_init`.
    """

    def __init__(self, *args, sp_size: int | None = None, strategy: str = "burst", layout: str = "zigzag",
                 attn_name: str = "burst", attention_options: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self, "model_init", None) is not None:
            raise NotImplementedError("SequenceParallelTrainer needs model= (model_init builds a new model per "
                                      "trial, which burst would have to hook each time)")
        self.sp_group, self.sp_size, self.replica, self.replicas = _sequence_parallel_groups(sp_size)
        self.sp_layout = layout
        self._refuse_inexact_settings()
        register(attn_name, strategy=strategy, layout=layout, group=self.sp_group, **(attention_options or {}))
        self.model.set_attn_implementation(attn_name)
        shard_mixers(self.model, self.sp_group, layout)
        check_model(self.model)

    def _refuse_inexact_settings(self) -> None:
        problems = []
        if self.label_smoother is not None:
            problems.append("label_smoothing_factor != 0 (the smoother shifts each rank's shard of the logits)")
        if self.compute_loss_func is not None:
            problems.append("compute_loss_func (it would see one rank's shard of the logits and labels)")
        if not self.model_accepts_loss_kwargs:
            problems.append(f"{type(self.model).__name__}.forward takes no num_items_in_batch (each rank would "
                            "average its own tokens)")
        if not self.args.average_tokens_across_devices:
            problems.append("average_tokens_across_devices=False (each rank would average its own tokens)")
        if problems:
            raise ValueError("SequenceParallelTrainer cannot train exactly with: " + "; ".join(problems))

    # Trainer reads these sizes to count the tokens that share a batch and the data-parallel world.
    def get_cp_size(self) -> int:
        return self.sp_size

    # ---- data: the replicas get different batches, the ranks of a group the same one -------------

    def get_train_dataloader(self):
        return self._over_replicas(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._over_replicas(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._over_replicas(super().get_test_dataloader(test_dataset))

    def _over_replicas(self, dataloader):
        """accelerate shards `dataloader` over every process; make it shard over the replicas."""
        if self.sp_size == 1:
            return dataloader
        shard = _accelerate_shard(dataloader)
        if shard is None:
            raise NotImplementedError(
                f"{type(dataloader).__name__}: burst re-points accelerate's per-process sampler (BatchSamplerShard or "
                "IterableDatasetShard) to the data-parallel replicas, and this dataloader has none (an iterable "
                "dataset dispatched from rank 0?): set accelerator_config={'dispatch_batches': False}")
        shard.num_processes, shard.process_index = self.replicas, self.replica
        if self.replicas == 1 and hasattr(shard, "even_batches"):
            # accelerate would not shard one process at all: no last batch filled up from the start
            shard.even_batches = False
        return dataloader

    # ---- inputs: each rank its shard ------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        shard, _ = self._shard(self._prepare_inputs(inputs))
        return super().training_step(model, shard, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        shard, length = self._shard(inputs, keep_count=True)
        count = shard.pop("num_items_in_batch", None)
        with torch.no_grad():
            outputs = model(**shard, **({} if count is None else {"num_items_in_batch": count}))
        loss = None if count is None else reduce_loss(outputs.loss, self.sp_group)  # this batch's mean
        if prediction_loss_only:
            return loss, None, None
        logits = layout_mod.unshard(outputs.logits.contiguous(), self.sp_group, self.sp_layout, dim=1)
        return loss, logits[:, :length], labels

    def _shard(self, inputs: dict, keep_count: bool = False) -> tuple[dict, int]:
        """(this rank's shard of `inputs`, the batch's length before padding). The token count that
        shard_batch adds is dropped for training: Trainer passes its own, over the accumulated batch."""
        whole, length = whole_sequences(inputs, _layout_multiple(self.sp_layout, self.sp_size))
        shard = shard_batch(whole, group=self.sp_group, layout=self.sp_layout)
        if not keep_count:
            shard.pop("num_items_in_batch", None)
        return shard, length

    # ---- evaluation: one copy of each replica's results ----------------------------------------

    @property
    def gather_function(self):
        return self._gather_replicas

    @gather_function.setter
    def gather_function(self, accelerate_gather):
        # Trainer sets accelerate's gather_for_metrics here (and resets it after each evaluation loop);
        # that gathers every process, each group's results sp_size times over.
        self._accelerate_gather = accelerate_gather

    def _gather_replicas(self, data):
        if self.sp_size == 1:
            return self._accelerate_gather(data)
        if isinstance(data, (list, tuple)):
            return type(data)(self._gather_replicas(d) for d in data)
        if isinstance(data, dict):
            return {k: self._gather_replicas(v) for k, v in data.items()}
        gathered = self.accelerator.gather(data)  # (world * batch, ...) in rank order
        per_rank = gathered.reshape(self.replicas, self.sp_size, -1, *gathered.shape[1:])[:, 0]
        kept = per_rank.reshape(-1, *gathered.shape[1:])
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the replicas' padding of the last batch
            kept = kept[: state.remainder]
        return kept


def _sequence_parallel_groups(sp_size: int | None):
    """(this rank's group, sp_size, replica index, replica count); groups of consecutive ranks,
    made on every rank (new_group is collective)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    sp_size = world if sp_size is None else sp_size
    if sp_size < 1 or world % sp_size:
        raise ValueError(f"sp_size={sp_size} must divide the world size {world}")
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


def _accelerate_shard(dataloader):
    """accelerate's per-process sharding object inside a prepared dataloader, or None."""
    for candidate in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)):
        if candidate is not None and hasattr(candidate, "num_processes") and hasattr(candidate, "process_index"):
            return candidate
    return None


def _layout_multiple(layout: str, world: int) -> int:
    """What the sequence length must be a multiple of for `layout` over `world` ranks."""
    if layout in layout_mod.DOCUMENT_LAYOUTS:  # each document cut on its own: the batch's business
        return 1
    return layout_mod.local_multiple(layout) * world


def whole_sequences(batch: dict, multiple: int, ignore_index: int = -100) -> tuple[dict, int]:
    """(batch ready for shard_batch, its length before padding): right padding (attention_mask ones
    then zeros in each row, as Trainer's collators pad, labels `ignore_index` there) is dropped from
    the mask, which is exact for a causal model (no real token sees a later one); the length is
    padded at the end to a multiple of `multiple` the same way. Left padding, holes and labels on
    padded positions raise (the model would score tokens whose logits one process computes otherwise)."""
    out = dict(batch)
    ids = out["input_ids"]
    length = ids.shape[1]
    mask = out.pop("attention_mask", None)
    labels = out.get("labels")
    if mask is not None:
        keep = mask.bool()
        right_padded = bool((keep.cummin(dim=1).values == keep).all())
        if not right_padded:
            raise ValueError("attention_mask has zeros before ones (left padding or holes): burst runs whole "
                             "sequences; pad on the right (tokenizer.padding_side = 'right') or pack documents")
        if labels is not None and bool((labels[~keep] != ignore_index).any()):
            raise ValueError(f"labels at padded positions (attention_mask 0) must be {ignore_index}, as "
                             "DataCollatorForLanguageModeling makes them")
    pad = -length % multiple
    if pad:
        out["input_ids"] = torch.nn.functional.pad(ids, (0, pad))
        if out.get("labels") is not None:
            out["labels"] = torch.nn.functional.pad(out["labels"], (0, pad), value=ignore_index)
        positions = out.get("position_ids")
        if positions is not None:  # the padding continues the last document
            tail = positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)
            out["position_ids"] = torch.cat([positions, tail], dim=1)
    return out, length
