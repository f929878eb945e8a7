"""A family's training step on burst's backend against the same model with eager attention in one
process: its twin (the same weights on another attention implementation), the step's logits, loss and
every parameter's gradient (gradient_error, the zoo's rule). The zoo (hf_zoo.py) and the transformers
tests run their comparisons through these."""

from __future__ import annotations

import copy

import torch

from .hf_zoo_configs import VOCAB, causal_lm, draw, tiny_config


def twin_on(model_type: str, twin, config, attn_implementation: str, switch: bool = True):
    """`twin` (a copy of the eager model taken before any forward: a module may keep state from one)
    on attn_implementation: switched by transformers' set_attn_implementation (a third of the zoo's build
    time was building each twin anew), or where the family cannot switch (or switch=False), a model
    built anew from `config` with twin's weights loaded."""
    if switch:
        twin.set_attn_implementation(attn_implementation)
        if twin.config._attn_implementation == attn_implementation:
            return twin
    model = causal_lm(model_type, copy.deepcopy(config), attn_implementation=attn_implementation)
    model.load_state_dict(twin.state_dict())
    return model


def twin_models(model_type: str, attn_implementation: str, config=None, reference_config=None):
    """(the family's model with eager attention, the same weights on `attn_implementation`), in
    training mode: for a training step's comparison (step_errors). config: the family's tiny config
    unless given; reference_config: the eager twin's own config (a planted difference), default the same."""
    config = tiny_config(model_type) if config is None else config
    torch.manual_seed(0)
    eager = causal_lm(model_type, copy.deepcopy(reference_config or config), attn_implementation="eager")
    draw(model_type, eager)
    if reference_config is not None:  # a twin with a config of its own: built from it, eager's weights loaded
        return eager, twin_on(model_type, eager, config, attn_implementation, switch=False)
    return eager, twin_on(model_type, copy.deepcopy(eager), config, attn_implementation)


def train_step_errors(
    model_type: str, name: str, layout: str, group=None, seq_len: int = 64, checkpointing: bool = False
) -> dict:
    """step_errors of the family's tiny model (batch 2 of seq_len tokens) on the burst backend `name`.
    checkpointing: the split model recomputes each layer in the backward. Call on every rank of the
    group alike."""
    eager, model = twin_models(model_type, name)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
    return step_errors(eager, model, ids, layout, group)


def eager_reference(eager, ids: torch.Tensor):
    """`eager`'s output on ids (batch, seq_len), as labels too, its gradients left on its parameters:
    what step_errors compares a split model with (pass it again for another split twin of the same
    weights instead of running eager again)."""
    expected = eager(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()
    return expected


def step_errors(eager, model, ids: torch.Tensor, layout: str, group=None, expected=None) -> dict:
    """One forward + backward of `model` split over `group` (shard_batch, reduce_gradients) against
    `eager` in this process on the same ids (batch, seq_len): the max abs difference of the logits
    and the loss, and gradient_error over every parameter's gradient. expected: eager_reference(eager,
    ids) when already run. Call on every rank alike."""
    expected = eager_reference(eager, ids) if expected is None else expected
    logits, loss = sharded_step(model, ids, layout, group)
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()) if q.grad is not None]
    return {
        "logits": (logits - expected.logits).abs().max().item(),
        "loss": abs(loss - expected.loss.item()),
        "gradients": gradient_error(pairs),
        "gradient_count": len(pairs),
    }


def sharded_step(model, ids: torch.Tensor, layout: str, group=None) -> tuple[torch.Tensor, float]:
    """One training step's forward and backward of `model` on this rank's shard of ids (batch, seq_len),
    as a user runs it (shard_batch(model=), reduce_gradients): (the whole sequence's logits, the
    global mean loss). The gradients are left on the parameters. Call on every rank alike."""
    from .. import layout as layout_mod
    from ..integrations import transformers as bt

    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, group=group, layout=layout, model=model)
    got = model(**batch, use_cache=False)
    got.loss.backward()
    bt.reduce_gradients(model, group)
    logits = layout_mod.unshard(got.logits.detach().contiguous(), group=group, layout=layout, dim=1)
    return logits, bt.reduce_loss(got.loss.detach(), group).item()


def gradient_error(pairs) -> float:
    """The largest of each (got, expected) gradient pair's max abs difference relative to the expected
    gradient's max, or to 1/100 of the largest expected gradient where that is more: fp32 rounding of
    the sums is relative to the whole model's scale, not to a parameter whose gradient is near zero."""
    floor = 1e-2 * max(q.abs().max().item() for _, q in pairs)
    return max((p - q).abs().max().item() / max(q.abs().max().item(), floor) for p, q in pairs)
