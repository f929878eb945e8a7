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
import transformers
from packaging.version import Version
from transformers import Trainer

from burst import layout as layout_mod

from .backend.attention import TESTED_TRANSFORMERS
from .backend.batches import reduce_loss
from .fused_loss import check_fusable, fused_causal_lm_loss
from .sequence_parallel import over_replicas, prepare_model, sequence_parallel_groups, shard_whole_sequences

# Trainer divides its token count by get_cp_size() from transformers 5.19 on (by accelerate's parallelism config
# alone before): on an older release every loss and gradient at sp_size > 1 would be 1/sp_size of one process's.
DIVIDES_BY_CP_SIZE = Version("5.19.0")


class SequenceParallelTrainer(Trainer):
    """`transformers.Trainer` whose every sequence is split over `sp_size` ranks by burst.

    sp_size: ranks per sequence (default: the world; W must be a multiple); the world's ranks
    r = replica * sp_size + s form the groups. strategy, layout and attention_options (a dict of
    further keywords): as for `bt.register` (`burst.attention`). attn_name: the attention
    implementation name the model is switched to. fused_loss: the training loss from the final hidden
    states and the LM head a tile at a time, never the (batch, seq, vocab) logits (fused_loss.py; a
    causal LM whose logits are its head's). Everything else is Trainer's. What it cannot
    do exactly raises in __init__: label smoothing, a `compute_loss_func`, a model whose forward
    takes no `num_items_in_batch`, `average_tokens_across_devices=False`, `model_init`.
    """

    def __init__(
        self,
        *args,
        sp_size: int | None = None,
        strategy: str = "burst",
        layout: str = "zigzag",
        attn_name: str = "burst",
        attention_options: dict | None = None,
        fused_loss: bool = False,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if getattr(self, "model_init", None) is not None:
            raise NotImplementedError(
                "SequenceParallelTrainer needs model= (model_init builds a new model per "
                "trial, which burst would have to hook each time)"
            )
        self.sp_group, self.sp_size, self.replica, self.replicas = sequence_parallel_groups(sp_size)
        self.sp_layout = layout
        self.sp_fused_loss = fused_loss
        self._refuse_inexact_settings()
        if fused_loss:
            check_fusable(self.model)
        prepare_model(self.model, self.sp_group, strategy, layout, attn_name, attention_options)

    def _refuse_inexact_settings(self) -> None:
        problems = []
        if self.label_smoother is not None:
            problems.append("label_smoothing_factor != 0 (the smoother shifts each rank's shard of the logits)")
        if self.compute_loss_func is not None:
            problems.append("compute_loss_func (it would see one rank's shard of the logits and labels)")
        if not self.model_accepts_loss_kwargs:
            problems.append(
                f"{type(self.model).__name__}.forward takes no num_items_in_batch (each rank would "
                "average its own tokens)"
            )
        if self.neftune_noise_alpha is not None and self.sp_size > 1:
            problems.append(
                "neftune_noise_alpha (transformers scales NEFTune's noise by the length each rank sees: its shard, "
                "so the noise would be sqrt(sp_size) times one process's)"
            )
        if getattr(self.args, "train_sampling_strategy", None) == "batch_rebalance" and self.sp_size > 1:
            problems.append(
                "train_sampling_strategy='batch_rebalance' (its sampler deals every process rows of its own, and the "
                "ranks that split a sequence must hold the same batch): use 'group_by_length' or 'random'"
            )
        if not self.args.average_tokens_across_devices:
            problems.append("average_tokens_across_devices=False (each rank would average its own tokens)")
        if self.sp_size > 1 and Version(transformers.__version__) < DIVIDES_BY_CP_SIZE:
            problems.append(
                f"transformers {transformers.__version__} (its Trainer does not divide the token count by "
                f"get_cp_size(): every loss and gradient would be 1/sp_size of one process's; pip install "
                f"'transformers{TESTED_TRANSFORMERS}')"
            )
        if problems:
            raise ValueError("SequenceParallelTrainer cannot train exactly with: " + "; ".join(problems))

    # Trainer reads these sizes to count the tokens that share a batch and the data-parallel world.
    def get_cp_size(self) -> int:
        return self.sp_size

    def _track_num_input_tokens(self, inputs):
        """Trainer sums every process's count of the batch it collated; the ranks of a group hold the same one
        (each is sharded after): counted once per group (include_num_input_tokens_seen was sp_size times)."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.sp_size

    # ---- data: the replicas get different batches, the ranks of a group the same one -------------

    def get_train_dataloader(self):
        return self._over_replicas(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._over_replicas(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._over_replicas(super().get_test_dataloader(test_dataset))

    def _over_replicas(self, dataloader):
        return over_replicas(dataloader, self.replica, self.replicas, self.sp_size)

    # ---- inputs: each rank its shard ------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        shard, _ = self._shard(self._prepare_inputs(inputs))
        return super().training_step(model, shard, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (self.sp_fused_loss and model.training) or return_outputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # Trainer's own arithmetic around the loss (the token count, the world's scale), the model's
        # forward replaced by the fused loss: it hands Trainer a loss and no logits.
        return super().compute_loss(_FusedLossForward(model), inputs, False, num_items_in_batch)

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

    def _sp_model(self):
        """The transformers model under accelerate's and DDP's wrappers (what prepare_model set up)."""
        return self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model

    def _shard(self, inputs: dict, keep_count: bool = False) -> tuple[dict, int]:
        """(this rank's shard of `inputs`, the batch's length before padding). The token count that
        shard_batch adds is dropped for training: Trainer passes its own, over the accumulated batch."""
        shard, length = shard_whole_sequences(inputs, self._sp_model(), self.sp_group, self.sp_layout, self.sp_size)
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


class _FusedLossForward:
    """`model(**inputs)` as Trainer.compute_loss calls it, returning only the fused loss."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **inputs):
        return {"loss": fused_causal_lm_loss(self.model, inputs)}
