"""burst.check: does every strategy give single-device attention's answer on *this* cluster?

The field's worst bugs are silent: wrong gradients at 4-8 ranks, found only when training diverges.
`burst.check` runs each requested strategy x layout x causal x dtype on random inputs of the user's
shape, on the caller's own group, and compares the output, lse and dq/dk/dv with single-device
attention on the same inputs, computed in float64 (query rows in chunks, so it never holds more than
a chunk's scores). The report is the same on every rank (errors are the maximum over ranks) and
never raises on a mismatch: `report.ok` says whether every case is within its dtype's bound.

    report = burst.check(strategies=("burst", "ring"), seq_len=4096, heads=8, head_dim=64)
    print(report.table()); assert report.ok

Inputs, the float64 reference, the error measures and the bounds (float64 1e-10, float32 1e-4,
float16 5e-3, bfloat16 3e-2; relative to the reference's largest magnitude, lse absolute) are
burst/kernels/reference.py's, the same the tests and `burst bench` use.

(This module is burst.check; `burst.check` itself is the function. Import names from it with
`from burst.check import CheckReport`: `import burst.check as m` would give the function.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from . import api
from . import layout as layout_mod
from .comm.membership import group_size
from .kernels.reference import (
    BOUNDS,
    DTYPES,
    QUANTITIES,
    errors_against,
    full_inputs,
    full_reference,
    relative_error,
    within_bounds,
)


@dataclass
class CheckRow:
    """One case: its setting, the errors (max over ranks), the bound and the verdict.

    status: "ok", "FAIL" (an error over the bound, or NaN), or "skipped" (the strategy does not take
    this combination; `note` says why).
    """

    strategy: str
    layout: str
    causal: bool
    dtype: str
    errors: dict = field(default_factory=dict)
    bound: float = 0.0
    status: str = "ok"
    note: str = ""


@dataclass
class CheckReport:
    rows: list[CheckRow]
    world: int
    shape: dict

    @property
    def ok(self) -> bool:
        """True when no case failed (skipped cases do not count)."""
        return all(r.status != "FAIL" for r in self.rows) and any(r.status == "ok" for r in self.rows)

    @property
    def failures(self) -> list[CheckRow]:
        return [r for r in self.rows if r.status == "FAIL"]

    def table(self) -> str:
        quantities = QUANTITIES + (("dsinks",) if any("dsinks" in r.errors for r in self.rows) else ())
        head = "| strategy | layout | causal | dtype | " + " | ".join(quantities) + " | bound | status |"
        lines = [
            f"burst check on {self.world} ranks, shape {self.shape}",
            "",
            head,
            "|---" * (head.count("|") - 1) + "|",
        ]
        for r in self.rows:
            errs = [f"{r.errors[q]:.1e}" if q in r.errors else "-" for q in quantities]
            status = r.status if not r.note else f"{r.status}: {r.note}"
            lines.append(
                f"| {r.strategy} | {r.layout} | {r.causal} | {r.dtype} | "
                + " | ".join(errs)
                + f" | {r.bound:.0e} | {status} |"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "world": self.world, "shape": self.shape, "rows": [asdict(r) for r in self.rows]}


def check(
    strategies=None,
    layouts=None,
    causal=(False, True),
    seq_len: int = 1024,
    heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int = 64,
    dtype: str = "float32",
    group=None,
    batch: int = 1,
    seed: int = 0,
    device=None,
    sinks: bool = False,
) -> CheckReport:
    """Run every case on the caller's world and compare with float64 single-device attention.

    strategies / layouts: names, or None for every registered strategy / every layout. causal: the
    values to try. dtype: "float32" | "bfloat16" | "float16" | "float64" (or a tuple of them).
    seq_len is the global length (a multiple of 2 x world, so every layout applies). Every rank must
    call it with the same arguments (checked, like every burst call). Tensors live on `device` when
    given (e.g. CUDA tensors on a gloo group, several ranks sharing one GPU), else on this rank's GPU
    when CUDA is available and the group is not gloo, else on the CPU. sinks: also pass attention
    sinks (random, one per head) and compare their gradient ("dsinks", summed over the ranks).
    """
    world = group_size(group)
    strategies = tuple(strategies) if strategies is not None else tuple(api.STRATEGIES)
    layouts = tuple(layouts) if layouts is not None else layout_mod.LAYOUTS
    causals = (causal,) if isinstance(causal, bool) else tuple(causal)
    dtypes = (dtype,) if isinstance(dtype, str) else tuple(dtype)
    kv_heads = kv_heads or heads
    validate_arguments(strategies, layouts, dtypes, seq_len, heads, kv_heads, world)
    device = torch.device(device) if device is not None else _device(group)
    rows = []
    for dt in dtypes:
        for is_causal in causals:
            full = full_inputs(seed, batch, seq_len, heads, kv_heads, head_dim, DTYPES[dt], device)
            sink_logits = _sinks(seed, heads, DTYPES[dt], device) if sinks else None
            ref = full_reference(*full, causal=is_causal, sinks=sink_logits)
            for strategy in strategies:
                for lay in layouts:
                    rows.append(_run_case(full, ref, strategy, lay, is_causal, dt, group, world, sink_logits))
    shape = dict(batch=batch, seq_len=seq_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    return CheckReport(rows=rows, world=world, shape=shape)


def validate_arguments(strategies, layouts, dtypes, seq_len, heads, kv_heads, world) -> None:
    """ValueError for a request check() cannot run (`burst check` checks its options with it)."""
    for s in strategies:
        if s not in api.STRATEGIES:
            raise ValueError(f"unknown strategy {s!r}; available: {tuple(api.STRATEGIES)}")
    for lay in layouts:
        layout_mod.check_layout(lay)
    for dt in dtypes:
        if dt not in BOUNDS:
            raise ValueError(f"dtype must be one of {tuple(BOUNDS)}, got {dt!r}")
    if seq_len <= 0 or seq_len % (2 * world):
        raise ValueError(f"seq_len must be a positive multiple of 2 x world = {2 * world}, got {seq_len}")
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")


def _device(group) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sinks(seed: int, heads: int, dtype, device) -> torch.Tensor:
    """(heads,) sink logits of `dtype` (held in float64, as full_inputs holds its tensors)."""
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(heads, generator=g, dtype=torch.float64) * 2).to(dtype).to(device, torch.float64)


def _run_case(full, ref, strategy, lay, causal, dtype, group, world, sinks=None) -> CheckRow:
    row = CheckRow(strategy=strategy, layout=lay, causal=causal, dtype=dtype, bound=BOUNDS[dtype])
    q, k, v, dout = (layout_mod.shard(t, group=group, layout=lay).to(DTYPES[dtype]) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mine_sinks = sinks.to(DTYPES[dtype], copy=True).requires_grad_() if sinks is not None else None
    try:
        out, lse = api.attention(
            q, k, v, group=group, strategy=strategy, layout=lay, causal=causal, return_lse=True, sinks=mine_sinks
        )
    except (ValueError, NotImplementedError) as err:  # raised on every rank alike (agreement check)
        row.status, row.note = "skipped", _short(str(err))
        return row
    out.backward(dout)
    mine = [out, lse, q.grad, k.grad, v.grad]
    theirs = [layout_mod.shard(t, group=group, layout=lay, dim=2 if t.dim() == 3 else 1) for t in ref[:5]]
    local = errors_against(mine, theirs)
    row.errors = dict(zip(QUANTITIES, max_over_ranks([local[x] for x in QUANTITIES], group, world, out.device)))
    if sinks is not None:  # each rank holds its rows' share of the sinks' gradient: the sum is compared
        total = mine_sinks.grad.detach().to(torch.float64).clone()
        if world > 1:
            dist.all_reduce(total, group=group)
        row.errors["dsinks"] = relative_error(total, ref[5])
    if not within_bounds(row.errors, dtype):
        row.status = "FAIL"
    return row


def _short(message: str) -> str:
    first = message.split(";")[0]
    return first if len(first) <= 70 else first[:67] + "..."


def max_over_ranks(values: list[float], group, world: int, device) -> list[float]:
    """The largest error of each quantity over the ranks (NaN wins), identical on every rank."""
    t = torch.tensor(
        [float("inf") if math.isnan(x) else x for x in values],
        dtype=torch.float64,
        device=device if device.type == "cuda" else "cpu",
    )
    nan = torch.tensor([float(math.isnan(x)) for x in values], dtype=torch.float64, device=t.device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(nan, op=dist.ReduceOp.MAX, group=group)
    return [float("nan") if n else x for x, n in zip(t.tolist(), nan.tolist())]
