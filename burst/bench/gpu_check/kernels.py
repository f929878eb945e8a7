"""Section 1: every kernel path burst selects on this device, through the block step, against
float64 for every mask kind and dtype; which kernel served which tile; torch SDPA's own backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from burst import layout as layout_mod
from burst.kernels import aten_flash, cpu_flash, cuda_flash_attn, cuda_sdpa, cudnn, flex, reference
from burst.masks import MaskSpec

from .cases import (
    DTYPE_NAMES,
    KERNEL_CASES,
    Sizes,
    block_step,
    compare,
    float64_reference,
    mask_spec,
    random_inputs,
    release_memory,
    tile_summary,
)
from .report import Report, Section, first_line


def kernel_paths(device: torch.device, sizes: Sizes) -> list:
    """(label, module, dtypes) for every kernel burst selects on `device`, each forced in turn."""
    halves = tuple(getattr(torch, d) for d in sizes.kernel_dtypes)
    if device.type == "cuda":
        paths = [("cuda_sdpa", cuda_sdpa, halves)]
        if aten_flash.available():
            paths.append(("aten_flash", aten_flash, tuple(d for d in halves if d in aten_flash.DTYPES)))
        if cudnn.available():  # its masked tiles run on aten_flash: the rows show both
            paths.append(("cudnn", cudnn, tuple(d for d in halves if d in cudnn.SPEC.dtypes)))
        if flex.available():
            paths.append(("flex", flex, halves))
        if cuda_flash_attn.available():
            paths.append(("cuda_flash_attn", cuda_flash_attn, tuple(d for d in halves if d in cuda_flash_attn.DTYPES)))
    else:
        paths = [("cpu_flash", cpu_flash, halves)]
    paths.append(("reference", reference, (torch.float64,)))
    return [p for p in paths if not sizes.kernel_names or p[0] in sizes.kernel_names]


def kernel_rows(sec: Section, device: torch.device, sizes: Sizes, paths) -> list:
    """Section 1's rows: each path x head dim x dtype x mask kind, block step vs float64."""
    rows = []
    for label, kernel, dtypes in paths:
        for dim in sizes.kernel_dims:
            for dtype in dtypes:
                n = min(sizes.kernel_len, 1024) if dtype == torch.float64 else sizes.kernel_len
                base = random_inputs(1, n, sizes.kernel_heads, sizes.kernel_kv_heads, dim, dtype, device, seed=dim)
                scale = dim**-0.5
                for kind in KERNEL_CASES:
                    if sec.skip_for_time(f"{label} dim {dim} {DTYPE_NAMES[dtype]} {kind}", 2.0):
                        return rows
                    row = {
                        "kernel": label,
                        "dtype": DTYPE_NAMES[dtype],
                        "head_dim": dim,
                        "mask": kind,
                        "shape": f"{n} tok, {sizes.kernel_heads}/{sizes.kernel_kv_heads} heads",
                    }
                    tensors, where = base, {}
                    if kind == "causal_striped":  # rank 0's queries and dO, rank 1's keys and values, G = 2
                        spec = MaskSpec(causal=True)
                        tensors = [base[0][:, 0::2], base[1][:, 1::2], base[2][:, 1::2], base[3][:, 0::2]]
                        where = {
                            "q_segs": layout_mod.segments("striped", 0, 2, n // 2),
                            "k_segs": layout_mod.segments("striped", 1, 2, n // 2),
                        }
                    else:
                        spec = mask_spec(kind, n)
                    try:
                        mine, tiles = block_step(kernel, *tensors, spec, scale, max(n // 2, 1), **where)
                        positions = (
                            {f"{x}_pos": torch.cat([s.positions() for s in where[f"{x}_segs"]]) for x in "qk"}
                            if where
                            else {}
                        )
                        ref = float64_reference(*tensors, spec, scale, **positions)
                        errors, ok = compare(mine, ref, DTYPE_NAMES[dtype])
                        row.update(
                            errors,
                            status="ok" if ok else "FAIL",
                            tiles=tile_summary(kernel, tensors[0], tensors[1], tiles),
                        )
                        del mine, ref
                    except Exception as err:  # noqa: BLE001 - the row records it; the others still run
                        row.update(status="FAIL", tiles=f"raised {first_line(err)}")
                    row["bound"] = reference.BOUNDS[DTYPE_NAMES[dtype]]
                    if row["status"] != "ok":
                        sec.fail(f"{label} {row['dtype']} dim {dim} {kind}: {row.get('tiles')}")
                    rows.append(row)
                release_memory(device)
    return rows


def sdpa_rows(sec: Section, device: torch.device, sizes: Sizes) -> list:
    """torch SDPA's backends (the yardstick of section 3) on full and causal, vs float64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    rows = []
    n, dim = sizes.kernel_len, sizes.kernel_dims[-1]
    for name in backends:
        backend = getattr(SDPBackend, name, None)
        for dtype_name in sizes.kernel_dtypes:
            for kind in ("full", "causal"):
                if sec.skip_for_time(f"SDPA {name} {dtype_name} {kind}", 2.0):
                    return rows
                dtype = getattr(torch, dtype_name)
                q, k, v, dout = random_inputs(1, n, sizes.kernel_heads, sizes.kernel_kv_heads, dim, dtype, device)
                row = {"backend": name, "dtype": dtype_name, "mask": kind, "head_dim": dim}
                try:
                    if backend is None:
                        raise RuntimeError(f"torch {torch.__version__} has no SDPBackend.{name}")
                    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                    group = q.shape[2] // k.shape[2]
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(
                            qq.transpose(1, 2),
                            kk.repeat_interleave(group, 2).transpose(1, 2),
                            vv.repeat_interleave(group, 2).transpose(1, 2),
                            is_causal=kind == "causal",
                        ).transpose(1, 2)
                        out.backward(dout)
                    ref = float64_reference(q, k, v, dout, mask_spec(kind, n), dim**-0.5)
                    errors, ok = compare((out, None, qq.grad, kk.grad, vv.grad), ref, dtype_name)
                    row.update(errors, status="ok" if ok else "over bound")  # torch's, not burst's: noted only
                    if not ok:
                        sec.note(f"torch SDPA {name} {dtype_name} {kind} is over burst.check's bound: {errors}")
                except RuntimeError as err:  # a backend that does not take this dtype / device: not ours
                    row.update(status="unsupported", note=first_line(err)[:90])
                rows.append(row)
                release_memory(device)
    return rows


def section_kernels(rep: Report) -> None:
    with rep.section("1", "Exactness of every kernel path (block step vs float64)") as sec:
        sizes, device = rep.sizes, rep.device
        sec.note(
            "burst selects per dtype: "
            + ", ".join(f"{d} -> {m}" for d, m in rep.facts["selected_kernels"].items())
            + ". cuda_sdpa calls aten's memory-efficient SDPA op directly, aten_flash aten's flash ops (both return "
            "lse and take the backward's lse); flash/cuDNN/math below are torch's SDPA, checked as the yardstick."
        )
        if device.type == "cuda" and not cuda_flash_attn.available():
            sec.note("flash_attn is not importable here: the cuda_flash_attn path did not run.")
        rows = kernel_rows(sec, device, sizes, kernel_paths(device, sizes))
        sec.table(
            "block step vs float64 (errors relative to max |ref|, lse absolute)",
            ["kernel", "dtype", "head_dim", "mask", "out", "lse", "dq", "dk", "dv", "bound", "status", "tiles"],
            rows,
        )
        sec.table(
            "torch SDPA backends vs float64 (no lse: SDPA returns none)",
            ["backend", "dtype", "mask", "out", "dq", "dk", "dv", "status", "note"],
            sdpa_rows(sec, device, sizes),
        )
