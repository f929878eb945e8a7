"""burst.attention(..., return_lse=True)'s lse is differentiable (issue 68 item 5): d lse_i / d s_ij = P_ij.

A loss through out and lse, through lse alone, and the cascade merge of burst's (out, lse) with another
partial attention (the other keys every rank holds, merged by lse as merge.py merges) must give q, k, v
(and the sinks) the gradients of float64 attention on the full sequence. One world per size (1-3
ranks: 3 is odd and more than two ring steps; 4 took no other path, and ulysses, which 4 heads over 3 ranks
refuse, runs at 1 and 2), cases looped inside: every strategy that runs there, causal or not, MHA and GQA, with and
without sinks, one tensor as keys and values, compressed entries, and MLA's latent
(burst.attention(q, latent=...)); and one compiled call (the custom op's backward).
"""

from __future__ import annotations

import burst
import pytest
import torch
import torch.distributed as dist
from burst.kernels.reference import attention as reference_attention

from cases import TOL, full_inputs, reference_mask, rel_err, strategy_kwargs
from test_latent import NOPE, ROPE, VD, expand
from test_latent import B as LB
from test_latent import H as LH
from test_latent import full as latent_inputs
from world import results_by_world

N_LOCAL, H, D, EXTRA = 8, 4, 8, 3
STRATEGIES = (
    "burst",
    "burst:chunk_rows=4",
    "burst:backward_side=keys",
    "burst:backward_side=queries",
    "ring",
    "allgather",
    "distflash",
    "ulysses",
    "usp",
    "cqs",
)
LOSSES = ("out and lse", "lse alone", "cascade")
SINKS_STRATEGIES = ("burst", "ring", "ulysses")


def _runs(strategy: str, causal: bool, world: int) -> bool:
    """distflash takes causal attention only; ulysses splits 4 heads over 1, 2 or 4 ranks."""
    name = strategy.split(":")[0]
    return not ((name == "distflash" and not causal) or (name == "ulysses" and world == 3))


def _loss(out, lse, loss: str, weights, other=None):
    """The case's loss of (out, lse); `other` is the second partial's (out, lse) for the cascade."""
    w, u = weights
    if loss == "out and lse":
        return (out * w).sum() + (lse * u).sum()
    if loss == "lse alone":
        return (lse * u).sum()
    other_out, other_lse = other  # the cascade: merged by lse, as a caller merges two partials
    merged = torch.logaddexp(lse, other_lse)

    def weight(x):
        return torch.exp(x - merged).transpose(1, 2)[..., None]

    return ((weight(lse) * out + weight(other_lse) * other_out) * w).sum()


def _weights(n, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n, H, D, generator=g, dtype=torch.float64), torch.randn(
        2, H, n, generator=g, dtype=torch.float64
    )


def _extra(hk, seed=8):
    """The cascade's other keys and values (every rank holds them whole, every query attends them)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, EXTRA, hk, D, generator=g, dtype=torch.float64) for _ in range(2)]


def _sinks():
    return torch.randn(H, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2


def _reference(full, mask, loss, weights, sinks=None):
    """float64 dq, dk, dv (and dsinks) of the loss on the full sequence."""
    q, k, v = (t.clone().requires_grad_() for t in full[:3])
    s = sinks.clone().requires_grad_() if sinks is not None else None
    if loss == "cascade":  # attention over the sequence and the other keys at once
        ke, ve = _extra(k.shape[2])
        keys, values = torch.cat([k, ke], 1), torch.cat([v, ve], 1)
        mask = torch.cat([mask, torch.ones(mask.shape[0], EXTRA, dtype=torch.bool)], 1)
        out, _ = reference_attention(q, keys, values, mask=mask, sinks=s)
        (out * weights[0]).sum().backward()
    else:
        out, lse = reference_attention(q, k, v, mask=mask, sinks=s)
        _loss(out, lse, loss, weights).backward()
    return (*(_grad(t) for t in (q, k, v)), s.grad if s is not None else None)


def _grad(t):
    """t's gradient; zeros where the loss does not reach t (lse alone does not read v)."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _summed(t):
    t = t.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _case(full, ref, loss, weights, strategy, causal, sinks=None):
    """This rank's relative errors of dq, dk, dv (and of the sinks' gradient, summed over ranks) against `ref`."""
    q, k, v = (burst.shard(t).clone().requires_grad_() for t in full[:3])
    s = sinks.clone().requires_grad_() if sinks is not None else None
    w, u = burst.shard(weights[0]), burst.shard(weights[1], dim=2)
    out, lse = burst.attention(q, k, v, causal=causal, return_lse=True, sinks=s, **strategy_kwargs(strategy))
    other = reference_attention(q, *_extra(k.shape[2])) if loss == "cascade" else None
    _loss(out, lse, loss, (w, u), other).backward()
    errors = {name: rel_err(_grad(x), burst.shard(r)) for name, x, r in zip(("dq", "dk", "dv"), (q, k, v), ref)}
    if sinks is not None:
        errors["dsinks"] = rel_err(_summed(s.grad), ref[3])
    return errors


def _caught(case, *args):
    """case(*args)'s errors, or {"raised": inf} with the message when its backward raises (lse without a
    gradient: "does not require grad")."""
    try:
        return case(*args)
    except RuntimeError as err:
        return {"raised": float("inf"), str(err).split("\n")[0]: float("inf")}


def _attention_cases(world):
    n = N_LOCAL * world
    weights = _weights(n)
    results = []
    for hk in (H, 2):  # MHA, GQA
        full = full_inputs(11, 2, n, H, hk, D, torch.float64)
        for causal in (False, True):
            mask = reference_mask(n, causal=causal)
            for loss in LOSSES:
                for with_sinks in (False, True):
                    sinks = _sinks() if with_sinks else None
                    ref = _reference(full, mask, loss, weights, sinks)
                    for strategy in SINKS_STRATEGIES if with_sinks else STRATEGIES:
                        if _runs(strategy, causal, world):
                            key = (
                                strategy,
                                f"heads {H}/{hk}",
                                "causal" if causal else "full",
                                loss,
                                "sinks" if with_sinks else "",
                            )
                            results.append((key, _caught(_case, full, ref, loss, weights, strategy, causal, sinks)))
    return results


def _shared_kv_cases(world):
    """One tensor as both keys and values (v is k: DeepSeek-V4's shared K = V): its gradient is both roles'."""
    n = N_LOCAL * world
    weights = _weights(n)
    full = full_inputs(14, 2, n, H, 1, D, torch.float64)
    results = []
    for loss in ("out and lse", "lse alone"):
        q, k = (t.clone().requires_grad_() for t in full[:2])
        out, lse = reference_attention(q, k, k, mask=reference_mask(n, causal=True))
        _loss(out, lse, loss, weights).backward()
        for strategy in ("burst", "burst:backward_side=queries", "ring", "allgather"):
            errors = _caught(_shared_kv_case, full, (q.grad, k.grad), loss, weights, strategy)
            results.append(((strategy, "v is k", "causal", loss, ""), errors))
    return results


def _shared_kv_case(full, ref, loss, weights, strategy):
    q, k = (burst.shard(t).clone().requires_grad_() for t in full[:2])
    out, lse = burst.attention(q, k, k, causal=True, return_lse=True, **strategy_kwargs(strategy))
    _loss(out, lse, loss, (burst.shard(weights[0]), burst.shard(weights[1], dim=2))).backward()
    return {name: rel_err(_grad(x), burst.shard(r)) for name, x, r in zip(("dq", "dk"), (q, k), ref)}


def _compressed_cases(world):
    """Compressed entries (burst/compressed.py) beside the sequence: their lse share has a gradient too."""
    n, rate = N_LOCAL * world, 4
    weights = _weights(n)
    full = full_inputs(12, 2, n, H, 1, D, torch.float64)
    g = torch.Generator().manual_seed(4)
    entries = [torch.randn(2, n // rate, 1, D, generator=g, dtype=torch.float64) for _ in range(2)]
    seen = torch.arange(n)[:, None] >= (torch.arange(n // rate)[None, :] + 1) * rate - 1
    results = []
    for loss in ("out and lse", "lse alone"):
        q, k, v, ck, cv = (t.clone().requires_grad_() for t in (*full[:3], *entries))
        out, lse = reference_attention(
            q, torch.cat([k, ck], 1), torch.cat([v, cv], 1), mask=torch.cat([reference_mask(n, causal=True), seen], 1)
        )
        _loss(out, lse, loss, weights).backward()
        ref = [_grad(t) for t in (q, k, v, ck, cv)]
        for strategy in ("burst", "ring", "allgather"):
            errors = _caught(_compressed_case, full, entries, rate, ref, loss, weights, strategy)
            results.append(((strategy, "compressed", "causal", loss, ""), errors))
    return results


def _compressed_case(full, entries, rate, ref, loss, weights, strategy):
    q, k, v = (burst.shard(t).clone().requires_grad_() for t in full[:3])
    ck, cv = (t.clone().requires_grad_() for t in entries)
    out, lse = burst.attention(
        q, k, v, causal=True, return_lse=True, strategy=strategy, compressed=burst.CompressedKV(ck, cv, rate)
    )
    _loss(out, lse, loss, (burst.shard(weights[0]), burst.shard(weights[1], dim=2))).backward()
    errors = {name: rel_err(_grad(x), burst.shard(r)) for name, x, r in zip(("dq", "dk", "dv"), (q, k, v), ref)}
    errors.update(dck=rel_err(_summed(ck.grad), ref[3]), dcv=rel_err(_summed(cv.grad), ref[4]))
    return errors


def _latent_cases(world):
    """MLA's latent on burst's ring: q, the latent, the rotary key, the weight (and the sinks)."""
    n = 12 * world
    inputs = latent_inputs(n)[:4]  # q, latent, rope, weight
    g = torch.Generator().manual_seed(6)
    weights = (
        torch.randn(LB, n, LH, VD, generator=g, dtype=torch.float64),
        torch.randn(LB, LH, n, generator=g, dtype=torch.float64),
    )
    results = []
    for causal in (False, True):
        mask = reference_mask(n, causal=causal)
        for loss in ("out and lse", "lse alone"):
            for sinks in (None, _sinks()[:LH]):
                ts = [t.clone().requires_grad_() for t in inputs]
                s = sinks.clone().requires_grad_() if sinks is not None else None
                out, lse = reference_attention(ts[0], *expand(*ts[1:]), scale=(NOPE + ROPE) ** -0.5, mask=mask, sinks=s)
                _loss(out, lse, loss, weights).backward()
                ref = [_grad(t) for t in ts] + [s.grad if s is not None else None]
                for rows in (None, 0):
                    errors = _caught(_latent_case, inputs, ref, loss, weights, causal, sinks, rows)
                    results.append(
                        (
                            (
                                "latent",
                                f"chunk_rows={rows}",
                                "causal" if causal else "full",
                                loss,
                                "" if sinks is None else "sinks",
                            ),
                            errors,
                        )
                    )
    return results


def _latent_case(inputs, ref, loss, weights, causal, sinks, rows):
    mine = [burst.shard(t).clone().requires_grad_() for t in inputs[:3]] + [inputs[3].clone().requires_grad_()]
    s = sinks.clone().requires_grad_() if sinks is not None else None
    out, lse = burst.attention(
        mine[0], latent=burst.LatentKV(*mine[1:], NOPE, VD), causal=causal, return_lse=True, sinks=s, chunk_rows=rows
    )
    _loss(out, lse, loss, (burst.shard(weights[0]), burst.shard(weights[1], dim=2))).backward()
    errors = {name: rel_err(_grad(x), burst.shard(r)) for name, x, r in zip(("dq", "dlatent", "drope"), mine, ref)}
    errors["dweight"] = rel_err(_summed(mine[3].grad), ref[3])
    if sinks is not None:
        errors["dsinks"] = rel_err(_summed(s.grad), ref[4])
    return errors


def _double_backward_cases(world):
    """A gradient of a gradient (create_graph=True: a penalty on dq) is refused on every rank before the backward
    sends anything: the strategies' backwards are not differentiable, and it came back without other ranks' part
    (ring, a softcap), or none at all (ulysses, burst with chunk_rows=0), silently."""
    full = full_inputs(17, 1, N_LOCAL * world, H, 2, D, torch.float64)
    said = {}
    for strategy in (s for s in (*STRATEGIES, "burst:chunk_rows=0", "ring:softcap=5") if _runs(s, True, world)):
        q, k, v = (burst.shard(t).clone().requires_grad_() for t in full[:3])
        out = burst.attention(q, k, v, causal=True, **strategy_kwargs(strategy))
        try:
            (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
            said[strategy] = f"no error (dq needs grad: {dq.requires_grad})"
        except RuntimeError as err:
            said[strategy] = str(err)
    return [(("double backward",), said)]


def _job(rank, world):
    cases = _attention_cases(world) + _shared_kv_cases(world) + _compressed_cases(world) + _latent_cases(world)
    return cases + (_double_backward_cases(world) if world > 1 else [])


_results = results_by_world(_job)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lse_gradient_matches_float64_attention(world):
    failures = []
    for rank, cases in enumerate(_results(world)):
        assert len(cases) == len(_results(world)[0]) > 0
        strategies = {key[0] for key, _ in cases}
        assert strategies >= {"burst", "ring", "allgather", "distflash", "usp", "cqs", "latent"}, strategies
        for key, errors in cases:
            if key == ("double backward",):
                failures += [f"rank {rank} {s}: {m}" for s, m in errors.items() if "has no double backward" not in m]
                continue
            if not all(e <= TOL[torch.float64] for e in errors.values()):  # NaN fails too
                failures.append(f"rank {rank} {key}: {errors}")
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures[:20])


def test_lse_gradient_under_torch_compile():
    """Compiled (one custom op, burst/custom_op.py: fullgraph), a loss through out and lse gives eager's
    gradients; one process, whose eager gradients the worlds above compare with float64 attention."""
    full = full_inputs(13, 1, 16, H, 2, D, torch.float64)
    w, u = (t[:1, :16] if t.dim() == 4 else t[:1, :, :16] for t in _weights(16))
    sinks = _sinks()

    def loss(q, k, v, s):
        out, lse = burst.attention(q, k, v, causal=True, return_lse=True, sinks=s)
        return (out * w).sum() + (lse * u).sum()

    def grads(fn):
        tensors = [t.clone().requires_grad_() for t in (*full[:3], sinks)]
        fn(*tensors).backward()
        return [t.grad for t in tensors]

    eager, compiled = grads(loss), grads(torch.compile(loss, fullgraph=True))
    q, k, v = (t.clone().requires_grad_() for t in full[:3])
    s = sinks.clone().requires_grad_()
    out, lse = reference_attention(q, k, v, mask=reference_mask(16, causal=True), sinks=s)
    _loss(out, lse, "out and lse", (w, u)).backward()
    assert max(rel_err(a, r) for a, r in zip(eager, (q.grad, k.grad, v.grad, s.grad))) <= TOL[torch.float64]
    assert max(rel_err(a, b) for a, b in zip(compiled, eager)) <= TOL[torch.float64]


def test_widened_backward_gives_way_to_a_kernel_that_takes_the_wider_head_dim():
    """lse's backward runs on head dims widened by lse_channel.CHANNELS: a call whose kernel stops at q's
    head dim (a GPU kernel's largest, 256) takes one that runs the widened dims for it."""
    from dataclasses import replace
    from types import SimpleNamespace

    from burst.lse_channel import CHANNELS
    from burst.prepare import prepare_single_device
    from burst.strategies.base import _widened_call

    q = torch.zeros(1, 8, H, D, dtype=torch.float64)
    _, call = prepare_single_device(q, q)
    narrow = SimpleNamespace(SPEC=SimpleNamespace(takes_head_dims=lambda h, v: h <= D and v <= D))
    wide = _widened_call(replace(call, kernel=narrow), q)
    assert wide.kernel is not narrow and wide.kernel.SPEC.takes_head_dims(D + CHANNELS, D + CHANNELS)
    assert _widened_call(call, q) is call  # the CPU's kernels take any head dim
