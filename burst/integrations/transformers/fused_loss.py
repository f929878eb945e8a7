"""A causal LM's loss without its logits: `fused_loss=True` of SequenceParallelTrainer and SequenceParallel.

transformers' causal LMs build the whole (batch, seq, vocab) logits and then the loss; at 128K tokens and
Llama 3's 128256 entries that is 64 GiB in float32, the first thing to run out at long sequences. Here
the model runs with `logits_to_keep=1` and `output_hidden_states=True`, and the loss is
burst.engine.fused_linear_cross_entropy of the final hidden states against the LM head's weight, a tile
at a time (burstengine.md §3.3). Exact only where the logits are `lm_head(hidden)`: each call checks the
one row of logits the model still makes against the head applied to the same hidden row, and refuses a
family that changes its logits after the head (a final softcap, a logit scale), before any backward.
"""

from __future__ import annotations

import torch

from burst.engine.loss import fused_linear_cross_entropy

from .backend.kept_logits import owned_by_burst
from .layers.router_loss import router_loss_share

# Config fields of families that transform their logits after the head. A softcap is near the identity
# on small logits, where the check of each call's last row could not see it: refused by name.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping")


def check_fusable(model) -> None:
    """Refuse, before training, a model whose LM head the fused loss cannot take (a plain weight, no bias,
    no softcap of the logits)."""
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    for field in LOGIT_TRANSFORMS:
        if any(getattr(c, field, None) for c in configs if c is not None):
            raise ValueError(
                f"fused_loss=True: {type(model).__name__} softcaps its logits after the LM head ({field}), which "
                "the fused loss leaves out; train it with fused_loss=False"
            )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"fused_loss=True needs a causal LM with a linear LM head; {type(model).__name__} has "
            f"{type(head).__name__}: train it with fused_loss=False"
        )
    if head.bias is not None:
        raise ValueError(f"fused_loss=True: {type(model).__name__}'s LM head has a bias, which the fused loss omits")


def fused_causal_lm_loss(model, inputs: dict) -> torch.Tensor:
    """The model's causal-LM loss for `inputs` (shard_batch's: `shift_labels` already shifted on the whole
    sequence, `num_items_in_batch` the labelled tokens it is averaged over; without it, this shard's mean),
    as the model computes it from its logits, without the logits. Returns a 0-dim float32 tensor."""
    inputs = dict(inputs)
    targets = inputs.pop("shift_labels", None)
    labels = inputs.pop("labels", None)
    count = inputs.pop("num_items_in_batch", None)
    if targets is None:
        if labels is None:
            raise ValueError("fused_loss=True needs labels in the batch")
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # one sequence, not sharded
    unwrapped = getattr(model, "module", model)  # under DDP's wrapper
    check_fusable(unwrapped)
    head = unwrapped.get_output_embeddings()
    if hasattr(head.weight, "full_tensor"):
        raise ValueError("fused_loss=True under FSDP (the LM head's weight sharded) is not supported yet")
    with owned_by_burst():  # one row, checked below against the head (each rank's last: any will do)
        outputs = model(**inputs, logits_to_keep=1, output_hidden_states=True)
    hidden = outputs.hidden_states[-1]
    _check_head_makes_the_logits(model, head, hidden, outputs.logits)
    mean = fused_linear_cross_entropy(hidden, head.weight, targets)
    router = router_loss_share(unwrapped, outputs)  # a MoE's load-balancing loss, which the labels would add
    if count is None:
        return mean + router
    labelled = (targets != -100).sum()
    return mean * labelled / count + router  # transformers' sum over this shard / the batch's labelled tokens


def _check_head_makes_the_logits(model, head, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """The model's last row of logits must be its head applied to the last hidden row (else the family
    transforms its logits after the head, which the fused loss would leave out)."""
    with torch.no_grad():
        expected = head(hidden[:, -1:]).to(logits.dtype)
    if logits.shape != expected.shape or not torch.allclose(logits, expected, rtol=1e-5, atol=1e-6):
        raise ValueError(
            f"fused_loss=True: {type(model).__name__}'s logits are not its LM head applied to its last hidden "
            "state (a logit scale, or hidden states reported before the final norm): the fused "
            "loss would differ from the model's; train it with fused_loss=False"
        )
