"""Section 7: burst beside the fastest attention torch ships on this device (issue 66).

One rank, forward + backward, in the speed dtype, head dim 128: burst.attention (its automatic kernel
and each CUDA kernel it can be told to run) beside SDPA's flash and cuDNN backends and compiled
FlexAttention, for full and causal attention with grouped (32/8) and multi-head (32/32) heads; a
sliding window, packed documents and softcap against FlexAttention (and SDPA on the documents as a batch);
the block steps of a G-rank ring summed against one call on the whole sequence (what a ring of G
GPUs can reach at most); on CUDA, each run's peak memory above the inputs. 'x best' is the fastest reference's seconds
over this row's (>= 1: as fast as the best reference).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

import burst
from burst.bench.harness import BenchConfig, attention_flops
from burst.kernels import KERNEL_ENV, cudnn, lse_for_backward, row_delta, select_kernel
from burst.kernels.accumulators import accumulator_zeros_like, empty_accumulators
from burst.kernels.attend import attend_backward, attend_forward
from burst.kernels.registry import kernels_by_name
from burst.layout import segments
from burst.masks import MaskSpec, TileSizes, plan_tiles
from burst.memory import held_bytes, peak_bytes, reset_peak
from burst.strategies.burst import side_bytes_per_row, smaller_side

from .cases import is_oom, random_inputs, release_memory
from .report import Report, first_line
from .speed import time_fwd_bwd


@contextlib.contextmanager
def forced_kernel(name: str | None):
    """burst.attention with BURST_KERNEL=name inside (None: its automatic choice)."""
    before = os.environ.get(KERNEL_ENV)
    if name:
        os.environ[KERNEL_ENV] = name
    try:
        yield
    finally:
        os.environ.pop(KERNEL_ENV, None)
        if before is not None:
            os.environ[KERNEL_ENV] = before


def _leaves(q, k, v):
    return [t.detach().requires_grad_() for t in (q, k, v)]


def burst_runner(q, k, v, dout, spec: MaskSpec, kernel: str | None = None, softcap: float = 0.0):
    qq, kk, vv = _leaves(q, k, v)
    mask = dict(causal=spec.causal, window=spec.window, cu_seqlens=spec.cu_seqlens)

    def forward():
        with forced_kernel(kernel):
            return burst.attention(qq, kk, vv, **mask, softcap=softcap)

    return forward, lambda out: out.backward(dout), lambda: None


def sdpa_runner(q, k, v, dout, spec: MaskSpec, backend: str, softcap: float = 0.0):
    """SDPA pinned to one backend on (b, h, s, d) views; documents as a batch of equal documents."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if spec.window is not None or softcap:
        raise RuntimeError("SDPA has no window or softcap argument")
    docs = len(spec.cu_seqlens) - 1 if spec.cu_seqlens is not None else 1
    pinned = [getattr(SDPBackend, backend)]
    gqa = q.shape[2] != k.shape[2] and _takes_gqa(pinned, q, k)
    if q.shape[2] != k.shape[2] and not gqa:  # this backend wants equal heads: KV repeated, as its users do
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], 2) for t in (k, v))
    shaped = [t.reshape(t.shape[0] * docs, t.shape[1] // docs, *t.shape[2:]).transpose(1, 2) for t in (q, k, v)]
    qq, kk, vv = _leaves(*shaped)
    dt = dout.reshape(qq.shape[0], -1, *dout.shape[2:]).transpose(1, 2)

    def forward():
        with sdpa_kernel(pinned):
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=spec.causal, enable_gqa=gqa)

    return forward, lambda out: out.backward(dt), lambda: None


def _takes_gqa(pinned, q, k) -> bool:
    """Whether SDPA's pinned backend runs grouped heads itself (enable_gqa), tried on a few rows."""
    from torch.nn.attention import sdpa_kernel

    few = [t[:, :64].transpose(1, 2) for t in (q, k)]
    try:
        with sdpa_kernel(pinned):
            F.scaled_dot_product_attention(few[0], few[1], few[1], enable_gqa=True)
        return True
    except RuntimeError:
        return False


def flex_runner(q, k, v, dout, spec: MaskSpec, softcap: float = 0.0):
    """Compiled flex_attention with the mask as a BlockMask (built once, outside the timing), and
    softcap as a score_mod (Gemma 2's: c * tanh(s / c))."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[1]
    allowed = _mask_mod(spec, q.device)
    block_mask = create_block_mask(allowed, None, None, n, n, device=q.device) if allowed else None
    flex = torch.compile(flex_attention)
    qq, kk, vv = _leaves(*(t.transpose(1, 2) for t in (q, k, v)))
    dt = dout.transpose(1, 2)
    capped = (lambda score, b, h, qi, ki: softcap * torch.tanh(score / softcap)) if softcap else None

    def forward():
        return flex(qq, kk, vv, score_mod=capped, block_mask=block_mask, enable_gqa=q.shape[2] != k.shape[2])

    return forward, lambda out: out.backward(dt), lambda: None


def _mask_mod(spec: MaskSpec, device):
    if not spec.causal and spec.window is None and spec.cu_seqlens is None:
        return None
    doc = None
    if spec.cu_seqlens is not None:
        bounds = torch.tensor(spec.cu_seqlens, device=device)
        doc = torch.bucketize(torch.arange(int(bounds[-1]), device=device), bounds[1:], right=True)
    left = spec.window[0] if spec.window is not None else -1

    def allowed(b, h, qi, ki):
        ok = ki <= qi if spec.causal else qi >= 0
        if left >= 0:
            ok = ok & (qi - ki <= left)
        if doc is not None:
            ok = ok & (doc[qi] == doc[ki])
        return ok

    return allowed


def one_call_runner(q, k, v, dout, spec: MaskSpec):
    """The kernel burst picks, one call forward and one backward on the whole sequence (full or
    causal): what the ring's tiles are held against."""
    kernel = select_kernel(q.device, q.dtype, head_dim=q.shape[-1], v_head_dim=v.shape[-1])
    scale = q.shape[-1] ** -0.5

    def forward():
        return kernel.forward(q, k, v, scale, spec.causal)

    def backward(result):
        out, lse = result
        kernel.backward(dout, q, k, v, out, lse, scale, spec.causal)

    return forward, backward, lambda: None


def ring_tiles_runner(q, k, v, dout, spec: MaskSpec, ranks: int):
    """The block steps of a `ranks`-rank ring (zigzag for causal), one rank after another on this
    device, with the work a rank does around them as the strategies do it: its float32 accumulators
    started once, each step's tiles merged into them, then out and D once, and each backward step's
    gradients added into float32 accumulators. The backward takes burst's smaller side: with grouped
    heads the keys travel and every query row has its own out; with multi-head attention the queries
    travel and a foreign block's out is rebuilt from D (kernels.out_from_delta). forward returns
    {rank: (out, lse, D)}, backward each rank's global rows and its float32 dq, dk, dv."""
    kernel = select_kernel(q.device, q.dtype, head_dim=q.shape[-1], v_head_dim=v.shape[-1])
    layout = "zigzag" if spec.causal else "contiguous"
    local = q.shape[1] // ranks
    segs = [segments(layout, r, ranks, local) for r in range(ranks)]
    rows = [torch.cat([s.positions() for s in seg]).to(q.device) for seg in segs]
    shards = [[t[:, idx] for t in (q, k, v, dout)] for idx in rows]
    sizes = TileSizes.for_kernel(kernel, join_runs=True)  # as AttentionCall.plan plans a call without indices
    tiles = {(r, src): plan_tiles(segs[r], segs[src], spec, sizes) for r in range(ranks) for src in range(ranks)}
    queries_travel = smaller_side(side_bytes_per_row(q, dout, k, v)) == "queries"
    scale = q.shape[-1] ** -0.5
    state = {}

    def forward():
        state.clear()
        for r in range(ranks):
            out_acc, lse = empty_accumulators(shards[r][0])
            for src in range(ranks):
                attend_forward(kernel, shards[r][0], *shards[src][1:3], tiles[r, src], out_acc, lse, scale)
            out = out_acc.to(q.dtype)
            del out_acc
            state[r] = (out, lse_for_backward(lse), row_delta(shards[r][3], out))
        return state

    def backward(_):
        dq = [accumulator_zeros_like(s[0]) for s in shards]
        dk = [accumulator_zeros_like(s[1]) for s in shards]
        dv = [accumulator_zeros_like(s[2]) for s in shards]
        for r in range(ranks):
            qr, _, _, dr = shards[r]
            out, lse, delta = state[r]
            for src in range(ranks):
                rebuilt = queries_travel and src != r
                attend_backward(
                    kernel, dr, qr, *shards[src][1:3], None if rebuilt else out, lse, tiles[r, src],
                    dq[r], dk[src], dv[src], scale, delta=delta,
                )  # fmt: skip
        return rows, dq, dk, dv

    return forward, backward, lambda: None


SHORT_ROW = 32768  # tokens up to which a runner is timed best of 3 (one pass of 16K causal stalled 2x on the H200)


def _time(runner, *args, **options) -> float:
    forward, backward, reset = runner(*args, **options)
    repeats = 3 if args[0].shape[1] <= SHORT_ROW else 1
    fwd, bwd = time_fwd_bwd(args[0].device, repeats, forward, backward, reset)
    return fwd + bwd


def _time_and_peak(runner, *args, **options) -> tuple[float, int]:
    """Seconds of a forward + backward and the peak bytes it held above what was held before (the
    inputs): the runner's own copies, outputs, gradients and work memory."""
    device = args[0].device
    floor = held_bytes(device)
    reset_peak(device)
    seconds = _time(runner, *args, **options)
    return seconds, peak_bytes(device) - floor


def _references(spec: MaskSpec, device, softcap: float = 0.0) -> dict:
    refs = {"FlexAttention": (flex_runner,)} if device.type == "cuda" else {}  # compiled for the CPU: minutes
    if spec.window is None and not softcap:  # SDPA takes neither
        refs = {"SDPA flash": (sdpa_runner, "FLASH_ATTENTION"), "SDPA cuDNN": (sdpa_runner, "CUDNN_ATTENTION"), **refs}
    return refs


def _burst_kernels(device, automatic: str) -> dict:
    """burst.attention with its automatic kernel (`automatic`, BURST_KERNEL's when set), and each other
    CUDA kernel it can be told to run here (the automatic one is not timed twice)."""
    named = {"burst": None}
    if device.type == "cuda":
        for name in ("cudnn", "aten_flash"):
            if name != automatic and kernels_by_name()[name].SPEC.available():
                named[f"burst ({name})"] = name
    return named


def _row(sec, label: str, spec: MaskSpec, inputs, burst_kernels: dict, softcap: float = 0.0) -> dict:
    q, k = inputs[0], inputs[1]
    row = {"work": label, "tokens": q.shape[1], "heads": f"{q.shape[2]}/{k.shape[2]}"}
    times = {}
    runners = {**_references(spec, q.device, softcap), **{n: (burst_runner, kn) for n, kn in burst_kernels.items()}}
    for name, (runner, *extra) in runners.items():
        try:
            seconds, peak = _time_and_peak(runner, *inputs, spec, *extra, softcap=softcap)
            times[name] = row[f"{name} ms"] = 1e3 * seconds
            if q.device.type == "cuda":  # the CPU's resident set does not drop between runners: not comparable
                row[f"{name} MiB"] = peak / 2**20
        except Exception as err:  # noqa: BLE001 - OOM or a backend that does not take this: the row says so
            row[f"{name} ms"] = "OOM" if is_oom(err) else type(err).__name__
            if not is_oom(err) and name.startswith("burst"):
                sec.fail(f"{name} {label} at {q.shape[1]} tokens: {first_line(err)}")
        release_memory(q.device)
    best = min((t for n, t in times.items() if not n.startswith("burst")), default=None)
    for name in burst_kernels:
        if best and name in times:
            row[f"{name} x best"] = best / times[name]
    fwd, bwd = attention_flops(
        BenchConfig(seq_len=q.shape[1], heads=q.shape[2], head_dim=q.shape[3], causal=spec.causal)
    )
    if "burst" in times:
        row["burst TFLOP/s"] = (
            (fwd + bwd) / times["burst"] / 1e9 if spec.window is None and spec.cu_seqlens is None else ""
        )
    return row


def section_references(rep: Report) -> None:
    """The first length's rows, its masks and the ring's tiles come first (the figures issue 66 asks
    for), then the other lengths while the budget lasts."""
    with rep.section("7", "Against the fastest kernels torch ships (SDPA flash, cuDNN, FlexAttention)") as sec:
        sizes, device = rep.sizes, rep.device
        dtype = getattr(torch, sizes.speed_dtype)
        heads, dim = sizes.ref_heads, min(128, sizes.speed_hidden // 2)
        automatic = select_kernel(device, dtype, head_dim=dim, v_head_dim=dim).__name__.rsplit(".", 1)[-1]
        kernels = _burst_kernels(device, automatic)
        sec.note(
            f"{sizes.speed_dtype}, batch 1, head dim {dim}, forward + backward ms (one warm-up pass, then the best "
            f"of 3 up to {SHORT_ROW} tokens, one pass above); "
            f"cuDNN available to burst: {cudnn.available()}; burst's automatic kernel: {automatic}"
        )
        first, *others = sizes.ref_lens
        rows = _plain_rows(sec, first, heads, dim, dtype, device, kernels)
        masks = _mask_rows(sec, first, heads, dim, dtype, device, _masks(first, kernels))
        ring = _ring_rows(sec, first, heads, dim, dtype, device)
        masks += _mask_rows(sec, first, heads, dim, dtype, device, _softcapped(device))
        for n in others:
            rows += _plain_rows(sec, n, heads, dim, dtype, device, kernels)
        rows.sort(key=lambda r: (r["tokens"], r["heads"] != f"{heads}/{heads // 4}", r["work"] != "full"))
        cols = [
            "work",
            "tokens",
            "heads",
            *[f"{r} ms" for r in _references(MaskSpec(), device)],
            *[f"{b} ms" for b in kernels],
            *[f"{b} x best" for b in kernels],
            "burst TFLOP/s",
        ]
        sec.table("one rank, full and causal", cols, rows)
        if device.type == "cuda":
            sec.table(
                "peak MiB above the inputs (the same runs)",
                ["work", "tokens", "heads", *[f"{r} MiB" for r in (*_references(MaskSpec(), device), *kernels)]],
                rows + masks,
            )
        sec.table(
            f"masks at {first} tokens (window and documents of {first // 16})",
            [
                "work",
                "tokens",
                "heads",
                "SDPA flash ms",
                "SDPA cuDNN ms",
                "FlexAttention ms",
                *[f"{b} ms" for b in kernels],
                *[f"{b} x best" for b in kernels],
            ],
            masks,
        )
        sec.table(
            f"the block steps of a G-rank ring summed against one call, {first} tokens (burst's {automatic})",
            ["work", "G", "one call ms", "tiles summed ms", "one call / tiles"],
            ring,
        )


def _plain_rows(sec, n, heads, dim, dtype, device, kernels) -> list:
    """Full and causal at `n` tokens, grouped (heads / 4 KV heads) and multi-head."""
    rows = []
    for kv in (heads // 4, heads):
        for label, spec in (("full", MaskSpec()), ("causal", MaskSpec(causal=True))):
            if sec.skip_for_time(f"{label} {heads}/{kv} at {n}", 8):
                continue
            rows.append(
                _row(sec, label, spec, random_inputs(1, n, heads, kv, dim, dtype, device, on_device=True), kernels)
            )
            release_memory(device)
    return rows


def _masks(n: int, kernels: dict) -> tuple:
    """A causal window of n / 16 and 16 causal documents of n / 16: (label, spec, burst's kernels,
    softcap, seconds to expect)."""
    part = n // 16
    return (
        ("window, causal", MaskSpec(causal=True, window=(part, 0)), kernels, 0.0, 8),
        ("16 documents, causal", MaskSpec(causal=True, cu_seqlens=tuple(range(0, n + 1, part))), kernels, 0.0, 8),
    )


def _softcapped(device) -> tuple:
    """Causal with Gemma 2's softcap (50), which burst runs on FlexAttention on CUDA: its automatic
    kernel only (the others take no softcap). Two compiles (FlexAttention's and burst's) there: last."""
    seconds = 90 if device.type == "cuda" else 8
    return (("softcap 50, causal", MaskSpec(causal=True), {"burst": None}, 50.0, seconds),)


def _mask_rows(sec, n, heads, dim, dtype, device, masked) -> list:
    """One row a mask of `masked` (`_masks`, `_softcapped`) at n tokens, grouped heads."""
    rows = []
    for label, spec, named, softcap, seconds in masked:
        if not sec.skip_for_time(f"{label} at {n}", seconds):
            inputs = random_inputs(1, n, heads, heads // 4, dim, dtype, device, on_device=True)
            rows.append(_row(sec, label, spec, inputs, named, softcap))
            release_memory(device)
    return rows


def _ring_rows(sec, n, heads, dim, dtype, device) -> list:
    rows = []
    for label, spec in (("full", MaskSpec()), ("causal", MaskSpec(causal=True))):
        inputs = random_inputs(1, n, heads, heads // 4, dim, dtype, device, on_device=True)
        try:
            whole = _time(one_call_runner, *inputs, spec)
        except Exception as err:  # noqa: BLE001
            sec.fail(f"one call {label} at {n}: {first_line(err)}")
            continue
        for g in (2, 4, 8):
            if sec.skip_for_time(f"ring tiles {label} G={g}", 4 * whole / 1e3 + 2):
                break
            summed = _time(ring_tiles_runner, *inputs, spec, g)
            rows.append(
                {
                    "work": label,
                    "G": g,
                    "one call ms": 1e3 * whole,
                    "tiles summed ms": 1e3 * summed,
                    "one call / tiles": whole / summed,
                }
            )
        del inputs
        release_memory(device)
    return rows
