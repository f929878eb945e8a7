"""Mixture-of-experts routers' load-balancing loss over the whole sequence, not each rank's shard.

A MoE causal LM (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, ...) run with `output_router_logits` adds to its loss
router_aux_loss_coef x aux, where aux = num_experts x sum_e (picks of expert e / rows) x (router probability of e
summed / rows), over every layer's rows (transformers' `load_balancing_loss_func`). On a shard each rank makes
aux of its own tokens and adds it whole: the sum over ranks counts it G times, and a product of per-shard means
is not the whole's product anyway (the router's gradient came out 0.85-3.6x off).

`balance_routers_across_ranks(model, group, layout)` (its entry of backend/features.py, so every door that
prepares a model) hooks the model's forward: each rank's per-expert sums (picks, probabilities, rows: 2E + 1
numbers) go to every rank in one differentiable all-gather (the probabilities' gradient reaches every rank's
router), aux is made of the whole's sums, the output's `aux_loss` becomes it, and in the output's loss this
rank's share, aux / G, replaces the shard's own aux (the sum over ranks, as reduce_loss takes it, is the
whole's). The shard's own aux is first remade from its router logits by that formula: a family whose aux is
another formula is refused on every rank, not silently mixed. The fused loss (fused_loss.py), which runs the
model without labels, adds the share itself (`router_loss_share`).
"""

from __future__ import annotations

import functools
import weakref

import torch

from burst import state_passing
from burst.custom_op import run_eagerly

from ..backend.registry import backend_of, running_cache, world_size

_HOOK = "_burst_router_loss_hook"
_ROWS = "_burst_router_rows"  # [(a shard's input_ids, its rows or None: all)] not yet run (count_rows)
REAL_TOKENS = "_burst_real_tokens"  # whole_sequences' entry: the tokens one process runs, not the padding
_MAX_PENDING = 64  # batches sharded and not yet run that count_rows remembers
_UNKNOWN = object()  # _rows_of: several batches pending, none this forward's


def balance_routers_across_ranks(model: torch.nn.Module, group=None, layout: str = "contiguous") -> int:
    """Hook `model`'s forward as the module docstring says (again on a new group); returns 1 where hooked, 0
    in a world of one rank. The hook does nothing where the output carries no aux_loss."""
    previous = getattr(model, _HOOK, None)
    if previous is not None:
        previous.remove()
        setattr(model, _HOOK, None)
    if world_size(group) == 1:
        return 0
    hook = functools.partial(_whole_sequence_aux, group=group)
    setattr(model, _HOOK, model.register_forward_hook(hook, with_kwargs=True))
    return 1


def count_rows(model: torch.nn.Module, real_tokens: torch.Tensor, input_ids: torch.Tensor) -> None:
    """Which of this rank's rows the router loss of the forward on `input_ids` (the shard's) counts: real_tokens
    (batch, seq_local) bool, the tokens one process runs (a collator's right padding, which it masks out of its
    router loss, and the layout's padding are not). Several batches may be sharded before their forwards
    (gradient accumulation): each forward takes its own batch's rows (_rows_of)."""
    pending = getattr(model, _ROWS, None) or []
    pending.append((weakref.ref(input_ids), None if bool(real_tokens.all()) else real_tokens))
    setattr(model, _ROWS, pending[-_MAX_PENDING:])


def _rows_of(model, args, kwargs):
    """The rows count_rows recorded for this forward's input_ids (taken off the list): those of the same
    tensor; else the one pending batch's (a Trainer may move the tensors to the device between); None with
    none pending (every row counts); _UNKNOWN when several are pending and none is this forward's."""
    pending = getattr(model, _ROWS, None) or []
    ids = kwargs.get("input_ids", args[0] if args else None)
    mine = [i for i, (ref, _) in enumerate(pending) if ids is not None and ref() is ids]
    if not mine and len(pending) > 1:
        setattr(model, _ROWS, None)
        return _UNKNOWN
    counted = pending.pop(mine[0] if mine else 0)[1] if pending else None
    setattr(model, _ROWS, pending)
    return counted


def router_loss_share(model: torch.nn.Module, outputs) -> torch.Tensor | float:
    """coef x aux / G: this rank's share of the router loss of `outputs` (its aux_loss the whole sequence's,
    as the hook leaves it), for a loss made without the model's own (the fused loss); 0 without one."""
    aux, coef = _field(outputs, "aux_loss"), _coefficient(model)
    if aux is None or not coef:
        return 0.0
    try:
        world = world_size(backend_of(model)[1].group)
    except ValueError:  # a model not on burst's backend: one process, its own aux whole
        world = 1
    return coef * aux / world


@run_eagerly  # a collective and host-side checks: torch.compile calls it as is
def _whole_sequence_aux(model, args, kwargs, output, group):
    counted = _rows_of(model, args, kwargs)
    aux, logits = _field(output, "aux_loss"), _field(output, "router_logits")
    if aux is None or not isinstance(logits, (tuple, list)) or not logits or running_cache() is not None:
        return None  # no router loss asked for, or a generate() step (whose aux nothing reads)
    if counted is _UNKNOWN:
        raise ValueError(
            f"{type(model).__name__}: several batches were sharded before their forwards, and this forward's "
            "input_ids are none of them: which of its rows the router loss counts is unknown; run each forward "
            "on the tensors its shard returned"
        )
    experts, top_k = _experts_of(model)
    coefficient = _coefficient(model)
    if coefficient is None:
        raise ValueError(
            f"{type(model).__name__} returns a router aux_loss but burst finds no coefficient it adds it with "
            f"({', '.join(COEFFICIENTS)}): run it with output_router_logits=False across ranks"
        )
    picks, probabilities, rows = _balance_sums(logits, experts, top_k)
    remade = experts * (picks / rows * probabilities / rows).sum()  # the family's own, of every row it ran
    differs = not torch.allclose(remade, aux.detach().float(), rtol=1e-4, atol=1e-6)
    if counted is not None and not differs:
        picks, probabilities, rows = _balance_sums(logits, experts, top_k, counted)
    mine = torch.cat([probabilities, picks, rows.reshape(1), rows.new_tensor([float(differs)])])
    gathered, anchor = state_passing.all_gather_tensors([mine], group, "router")
    total = torch.stack([parts[0] for parts in gathered]).sum(0)
    if total[-1] > 0:
        raise ValueError(
            f"{type(model).__name__}: its aux_loss is not the load-balancing loss burst makes whole across ranks "
            f"(num_experts x sum over experts of picks x probability, over every layer's rows; here {float(aux):.6g} "
            f"against {float(remade):.6g} on some rank): run it with output_router_logits=False across ranks"
        )
    probabilities, picks, rows = total[:experts], total[experts : 2 * experts], total[2 * experts]
    whole = experts * (picks / rows * probabilities / rows).sum() + anchor
    output["aux_loss"] = whole
    loss = _field(output, "loss")
    if loss is not None:  # the family added coef x its shard's aux: this rank's share of the whole's instead
        output["loss"] = loss + coefficient * (whole / world_size(group) - aux).to(loss.dtype)
    return output


def _balance_sums(logits, experts: int, top_k: int, counted=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(picks per expert (E,), router probabilities summed per expert (E,), rows ()) over every layer's
    router logits ((batch x seq_local, E) each), float32, as transformers' load_balancing_loss_func sums them;
    counted: (batch, seq_local) bool, the rows to count (its attention_mask), or None for all."""
    picks = torch.zeros(experts, dtype=torch.float32, device=logits[0].device)
    probabilities = torch.zeros_like(picks)
    rows = torch.zeros((), dtype=torch.float32, device=picks.device)
    weight = None if counted is None else counted.reshape(-1).to(picks.device, torch.float32)
    for layer in logits:
        weights = torch.softmax(layer.reshape(-1, experts).to(picks.device), dim=-1)
        if weight is not None and weight.numel() != weights.shape[0]:
            raise ValueError(
                f"router logits of {weights.shape[0]} rows for {weight.numel()} tokens: this transformers release "
                "arranges its router's rows differently from what burst knows; run it with output_router_logits=False"
            )
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        ones = torch.ones_like(chosen, dtype=torch.float32) if weight is None else weight.repeat_interleave(top_k)
        picks = picks + torch.zeros_like(picks).scatter_add_(0, chosen, ones)
        per_row = weights.float() if weight is None else weights.float() * weight[:, None]
        probabilities = probabilities + per_row.sum(0)
        rows = rows + (weights.shape[0] if weight is None else weight.sum())
    return picks, probabilities, rows


def _experts_of(model) -> tuple[int, int]:
    config = getattr(model, "config", None)
    experts = getattr(model, "num_experts", None) or _first(config, "num_experts", "num_local_experts")
    top_k = getattr(model, "num_experts_per_tok", None) or _first(config, "num_experts_per_tok")
    if not experts or not top_k:
        raise ValueError(
            f"{type(model).__name__} returns a router aux_loss but burst finds no num_experts / num_experts_per_tok "
            "on it or its config: run it with output_router_logits=False across ranks"
        )
    return int(experts), int(top_k)


# The names of the router loss's coefficient: on the model as its forward reads it, else on its config (JetMoE's
# is aux_loss_coef)
COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")


def _coefficient(model) -> float | None:
    for name in COEFFICIENTS:
        found = getattr(model, name, None)
        if found is not None:
            return found
    return _first(getattr(model, "config", None), *COEFFICIENTS)


def _first(config, *names):
    for name in names:
        value = getattr(config, name, None) if config is not None else None
        if value is not None:
            return value
    return None


def _field(output, name: str):
    """output[name] of a transformers ModelOutput (None where it has none); None for a tuple output."""
    return output.get(name) if hasattr(output, "get") else None
