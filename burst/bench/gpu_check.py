"""`scripts/gpu_check.sh DIR`: one prepared command that proves burst on a GPU (issue 27).

On a machine with one CUDA GPU it runs, each section in its own time budget under one global
deadline, and writes DIR/report.md and DIR/report.json after every section (a run cut short still
leaves what it measured):

1. kernels: every kernel path burst selects on this device, through the block step (masks.plan_tiles,
   block.attend_forward/attend_backward), against float64 (kernels/reference.py) for full, causal,
   window, documents and block-sparse masks and striped causal across two ranks, each dtype, GQA;
   which kernel served which tile; and torch SDPA's own backends (the speed yardstick).
2. worlds: burst.check (every strategy x layout x causal x dtype) and the masks through
   burst.attention on a one-rank world (NCCL on a GPU), then 2-4 ranks sharing the device with
   whichever backend takes it (probed: NCCL, then gloo with CUDA tensors, whose point-to-point
   transfers burst stages through host memory: comm/p2p.py).
3. speed: the block step and one-rank burst.attention fwd+bwd against torch SDPA's flash path.
4. memory: the longest sequence whose fwd+bwd fits, burst vs SDPA; peak per rank vs the 1/G share;
   the engine's model trained two steps at the longest length each checkpointing mode reaches.
5. CUDA-only features: FSDP2 CPU offload in `burst train`, bf16 autocast, `burst check`.

BURST_DEVICE=cpu runs the same code at tiny sizes on the CPU (the test suite does, so this cannot
rot); there "fits" in section 4 means a peak-RSS growth under a cap, not a CUDA out-of-memory.

    PYTHONPATH=. python3 -m burst.bench.gpu_check DIR [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import burst
from burst import api
from burst import layout as layout_mod
from burst.bench.harness import BenchConfig, attention_flops, run_strategy
from burst.kernels.accumulators import accumulator_zeros_like, empty_accumulators
from burst.kernels.attend import attend_backward, attend_forward
from burst.kernels import (cpu_flash, cuda_flash_attn, cuda_sdpa, lse_for_backward, reference, row_delta,
                           select_kernel)
from burst.check import max_over_ranks
from burst.launch import spawn_world
from burst.layout import Segment
from burst.masks import BlockSparseMask, MaskSpec, TileSizes, plan_tiles

MASK_KINDS = ("full", "causal", "window", "documents", "block_sparse")
# Section 1 also runs striped causal across ranks: rank 0's queries (positions 0, 2, ...) against rank
# 1's keys (1, 3, ...), j < i, which the planner turns into an (n-1) x (n-1) causal tile (odd sizes,
# unaligned strides) and whose first query attends nothing (an empty row).
KERNEL_CASES = MASK_KINDS + ("causal_striped",)
DTYPE_NAMES = {dtype: name for name, dtype in reference.DTYPES.items()}


@dataclass
class Sizes:
    """Every size the check uses; CUDA and CPU differ only here."""

    kernel_len: int            # tokens in section 1's block step (split into tiles of kernel_len // 2)
    kernel_heads: int
    kernel_kv_heads: int
    kernel_dims: tuple
    kernel_dtypes: tuple       # half/single precisions tried on each kernel path
    world_len: int             # global tokens in section 2's worlds
    world_heads: int
    world_kv_heads: int
    world_dim: int
    world_dtypes: tuple
    world_ranks: tuple         # several ranks on one device
    speed_lens: tuple
    speed_dims: tuple
    speed_hidden: int          # heads x head_dim in section 3
    speed_dtype: str
    speed_repeats: int
    world_speed_len: int       # section 3's several-rank run
    mem_batch: int             # section 4's longest-length search: batch x heads x head_dim
    mem_heads: int
    mem_dim: int
    mem_start: int
    mem_limit: int
    mem_cap_bytes: int | None  # CPU mode: "fits" = peak RSS growth under this (no OOM on a CPU)
    train_model: str
    train_start: int
    train_limit: int
    budgets: dict              # seconds per section
    spawn_timeout: float
    threads: int | None        # torch threads per process (None: torch's default)


CUDA_SIZES = Sizes(
    kernel_len=4096, kernel_heads=8, kernel_kv_heads=2, kernel_dims=(64, 128),
    kernel_dtypes=("float32", "float16", "bfloat16"),
    world_len=4096, world_heads=8, world_kv_heads=2, world_dim=128,
    world_dtypes=("float32", "bfloat16", "float16"), world_ranks=(2, 4),
    speed_lens=(8192, 16384, 32768, 65536, 131072), speed_dims=(64, 128), speed_hidden=2048,
    speed_dtype="bfloat16", speed_repeats=1, world_speed_len=32768,
    mem_batch=8, mem_heads=32, mem_dim=128, mem_start=8192, mem_limit=1 << 21, mem_cap_bytes=None,
    train_model="small", train_start=65536, train_limit=1 << 20,
    budgets={"1": 50, "2": 120, "3": 120, "4": 170, "5": 60}, spawn_timeout=120.0, threads=None,
)

CPU_SIZES = Sizes(
    kernel_len=128, kernel_heads=2, kernel_kv_heads=1, kernel_dims=(16,), kernel_dtypes=("float32", "bfloat16"),
    world_len=32, world_heads=2, world_kv_heads=1, world_dim=16, world_dtypes=("float32",), world_ranks=(2,),
    speed_lens=(128, 256), speed_dims=(16,), speed_hidden=32, speed_dtype="float32", speed_repeats=1,
    world_speed_len=128,
    mem_batch=1, mem_heads=2, mem_dim=16, mem_start=128, mem_limit=512, mem_cap_bytes=256 << 20,
    train_model="tiny", train_start=32, train_limit=64,
    budgets={"1": 30, "2": 60, "3": 20, "4": 30, "5": 40}, spawn_timeout=60.0,
    threads=1,  # tiny ops: one thread each is many times faster than threads spinning on a busy machine
)


# ---------------------------------------------------------------- the report


@dataclass
class Section:
    id: str
    title: str
    deadline: float
    status: str = "ok"          # ok | FAIL (a result out of bounds) | error (it raised) | running
    seconds: float = 0.0
    notes: list = dataclasses.field(default_factory=list)
    tables: list = dataclasses.field(default_factory=list)  # [{"name", "columns", "rows"}]
    error: str = ""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"[gpu_check {self.id}] {text}", flush=True)

    def table(self, name: str, columns: list, rows: list) -> None:
        self.tables.append({"name": name, "columns": list(columns), "rows": rows})

    def fail(self, why: str) -> None:
        self.status = "FAIL" if self.status != "error" else self.status
        self.note(f"FAIL: {why}")

    def skip_for_time(self, what: str, need: float = 0.0) -> bool:
        """True (and noted) when fewer than `need` seconds are left in this section's budget."""
        if self.left() > need:
            return False
        self.note(f"skipped for time: {what} (section budget spent)")
        return True


class Report:
    def __init__(self, outdir: str, device: torch.device, budget: float, sizes: Sizes):
        self.outdir, self.device, self.sizes = outdir, device, sizes
        self.start = time.monotonic()
        self.end = self.start + budget
        self.sections: list[Section] = []
        self._planned = self.start
        self.facts = environment(device)
        self.facts["budget_s"] = budget
        self.facts["sizes"] = dataclasses.asdict(sizes)

    @contextlib.contextmanager
    def section(self, sid: str, title: str):
        """A guarded section: an exception is recorded (status error) and the next section runs.
        Its deadline is the planned schedule's (unused time rolls forward), never past the end."""
        self._planned += self.sizes.budgets[sid]
        sec = Section(sid, title, min(self._planned, self.end))
        self.sections.append(sec)
        began = time.monotonic()
        print(f"[gpu_check {sid}] {title} ({sec.left():.0f} s)", flush=True)
        try:
            yield sec
        except Exception as err:  # noqa: BLE001 - one failing section must not stop the others
            sec.status = "error"
            sec.error = traceback.format_exc()
            sec.note(f"error: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
        finally:
            sec.seconds = time.monotonic() - began
            try:
                release_memory(self.device)
            except Exception as err:  # noqa: BLE001 - a sticky CUDA error: every later section will say so too
                sec.note(f"could not free device memory after this section: {_first_line(err)}")
            self.write()

    def as_dict(self) -> dict:
        return {**self.facts, "total_s": time.monotonic() - self.start,
                "ok": all(s.status == "ok" for s in self.sections),
                "sections": [dataclasses.asdict(s) for s in self.sections]}

    def write(self) -> None:
        os.makedirs(self.outdir, exist_ok=True)
        data = self.as_dict()
        with open(os.path.join(self.outdir, "report.json"), "w") as f:
            json.dump(data, f, indent=1, default=str)
        with open(os.path.join(self.outdir, "report.md"), "w") as f:
            f.write(markdown(data))


def markdown(data: dict) -> str:
    lines = [f"# burst GPU check: {data['device_name']}", "",
             f"Command: `{data['command']}`  ", f"burst commit {data['git_commit']}, torch {data['torch']}, "
             f"CUDA {data['cuda']}, flash_attn {data['flash_attn']}, mode {data['mode']}, "
             f"{data['total_s']:.0f} s of a {data['budget_s']:.0f} s budget"
             + (f", {data['gpu_memory_bytes'] / 2**30:.0f} GiB of GPU memory." if data["gpu_memory_bytes"] else "."), "",
             "| section | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['id']}. {s['title']} | {s['status']} | {s['seconds']:.0f} |" for s in data["sections"]]
    found = [f"- {s['id']}: {n}" for s in data["sections"] for n in s["notes"]
             if n.startswith(("FAIL", "error", "skipped for time", "could not"))]
    if found:
        lines += ["", "What to look at (failures, errors, what ran out of time):", "", *found]
    for s in data["sections"]:
        lines += ["", f"## {s['id']}. {s['title']} ({s['status']})", ""]
        lines += [f"- {n}" for n in s["notes"]]
        for t in s["tables"]:
            lines += ["", f"**{t['name']}**", "", "| " + " | ".join(t["columns"]) + " |",
                      "|" + "---|" * len(t["columns"])]
            lines += ["| " + " | ".join(_cell(r.get(c)) for c in t["columns"]) + " |" for r in t["rows"]]
        if s["error"]:
            lines += ["", "```", s["error"].strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _cell(x) -> str:
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        return f"{x:.1e}" if 0 < abs(x) < 1e-2 else f"{x:.3g}"
    return "-" if x is None else str(x).replace("|", "/")


def environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {
        "mode": device.type, "device_name": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
        "flash_attn": cuda_flash_attn.available(), "git_commit": _git_commit(), "python": sys.version.split()[0],
        "command": " ".join(["scripts/gpu_check.sh", *sys.argv[1:]]),
        "selected_kernels": {DTYPE_NAMES[dt]: select_kernel(device, dt).__name__.rsplit(".", 1)[-1]
                             for dt in DTYPE_NAMES},
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
    }


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def release_memory(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks back (after an OOM, between sizes); nothing on CPU."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


from .harness import _sync as sync  # noqa: E402 - one device sync for the bench and this check


def is_oom(err: BaseException) -> bool:
    """A CUDA out-of-memory (torch.cuda.OutOfMemoryError), or a host allocation failure."""
    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(err).lower()


# ---------------------------------------------------------------- comparison with float64


QUANTITIES = reference.QUANTITIES


def compare(mine, ref, dtype: str) -> tuple[dict, bool]:
    """burst.check's measure (reference.errors_against) and its verdict within reference.BOUNDS[dtype].
    mine / ref: (out, lse, dq, dk, dv), ref in float64; lse may be None on both (SDPA returns none).
    Returns (errors, ok)."""
    errors = reference.errors_against(mine, ref)
    return errors, reference.within_bounds(errors, dtype)


def mask_spec(kind: str, n: int, seed: int = 0) -> MaskSpec:
    """The mask kinds of section 1 on n tokens (uneven document cuts, seeded block layout)."""
    if kind == "full":
        return MaskSpec()
    if kind == "causal":
        return MaskSpec(causal=True)
    if kind == "window":
        return MaskSpec(window=(n // 8, n // 16))
    if kind == "documents":
        return MaskSpec(causal=True, cu_seqlens=(0, n // 3 + 1, n // 2 + 5, n))
    if kind == "block_sparse":
        blocks = 8
        g = torch.Generator().manual_seed(seed + 2)
        grid = (torch.rand(blocks, blocks, generator=g) < 0.4) | torch.eye(blocks, dtype=torch.bool)
        return MaskSpec(block_sparse=BlockSparseMask(n // blocks, grid))
    raise ValueError(f"mask kind must be one of {MASK_KINDS}, got {kind!r}")


def api_mask_kwargs(spec: MaskSpec) -> dict:
    return {"causal": spec.causal, "window": spec.window, "cu_seqlens": spec.cu_seqlens,
            "block_sparse": spec.block_sparse}


def float64_reference(q, k, v, dout, spec: MaskSpec, scale: float, q_pos=None, k_pos=None):
    """out, lse, dq, dk, dv of attention in float64 (kernels/reference.py: full_reference); q and k
    hold the global positions q_pos, k_pos (default: the whole sequence, 0..n-1)."""
    q_pos = torch.arange(q.shape[1]) if q_pos is None else q_pos
    k_pos = torch.arange(k.shape[1]) if k_pos is None else k_pos
    mask = None if spec.is_dense else spec.allowed(q_pos.to(q.device), k_pos.to(q.device))
    return reference.full_reference(q, k, v, dout, mask=mask, scale=scale)


def random_inputs(batch, n, heads, kv_heads, dim, dtype, device, seed=0, on_device=False):
    """q, k, v, dout in `dtype` on `device`: reference.full_inputs (drawn on the CPU from the seed, the
    same on every rank); on_device: drawn on `device` itself (the long timing and memory runs, where
    CPU draws would take seconds)."""
    if not on_device:
        return [t.to(dtype) for t in reference.full_inputs(seed, batch, n, heads, kv_heads, dim, dtype, device)]
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = [(batch, n, heads, dim), (batch, n, kv_heads, dim), (batch, n, kv_heads, dim), (batch, n, heads, dim)]
    return [torch.randn(s, generator=g, device=device, dtype=dtype) for s in shapes]


# ---------------------------------------------------------------- 1. kernels


def block_step(kernel, q, k, v, dout, spec: MaskSpec, scale: float, max_rows: int, q_segs=None, k_segs=None):
    """One block pair through the block step, as the strategies run it: tiles planned by
    masks.plan_tiles, merged forward, BurstAttention's delta backward. q_segs / k_segs: the global
    positions the blocks hold (layout.Segment runs; default the whole sequence)."""
    q_segs = q_segs or [Segment(0, q.shape[1], 0)]
    k_segs = k_segs or [Segment(0, k.shape[1], 0)]
    tiles = plan_tiles(q_segs, k_segs, spec, TileSizes(max_rows))
    out_acc, lse = empty_accumulators(q)
    attend_forward(kernel, q, k, v, tiles, out_acc, lse, scale)
    out = out_acc.to(q.dtype)
    del out_acc
    dq, dk, dv = accumulator_zeros_like(q), accumulator_zeros_like(k), accumulator_zeros_like(v)
    attend_backward(kernel, dout, q, k, v, None, lse_for_backward(lse), tiles, dq, dk, dv, scale,
                    delta=row_delta(dout, out))
    return (out, lse, dq, dk, dv), tiles


def tile_backend(kernel, q, k, tile) -> str:
    """Which function serves `tile` on `kernel` (flash_attn hands masked / non-square causal tiles
    to the SDPA op)."""
    name = getattr(kernel, "__name__", str(kernel)).rsplit(".", 1)[-1]
    if kernel is cuda_flash_attn:
        qt, kt = q[:, tile.q.rows], k[:, tile.k.rows]
        name = "flash_attn" if cuda_flash_attn.handles(qt, kt, tile.causal, tile.kernel_mask) else "cuda_sdpa(efficient)"
    elif kernel is cuda_sdpa:
        name = "cuda_sdpa(efficient)"
    return name + ("+mask" if tile.mask is not None else "") + (" causal" if tile.causal else "")


def tile_summary(kernel, q, k, tiles) -> str:
    counts = Counter(f"{t.cover.name} {t.q.length}x{t.k.length} -> {tile_backend(kernel, q, k, t)}" for t in tiles)
    return "; ".join(f"{what} x{n}" for what, n in counts.items()) or "no tile"


def kernel_paths(device: torch.device, sizes: Sizes) -> list:
    """(label, module, dtypes) for every kernel burst selects on `device`, each forced in turn."""
    halves = tuple(getattr(torch, d) for d in sizes.kernel_dtypes)
    if device.type == "cuda":
        paths = [("cuda_sdpa", cuda_sdpa, halves)]
        if cuda_flash_attn.available():
            paths.append(("cuda_flash_attn", cuda_flash_attn,
                          tuple(d for d in halves if d in cuda_flash_attn.DTYPES)))
    else:
        paths = [("cpu_flash", cpu_flash, halves)]
    return paths + [("reference", reference, (torch.float64,))]


def kernel_rows(sec: Section, device: torch.device, sizes: Sizes, paths) -> list:
    """Section 1's rows: each path x head dim x dtype x mask kind, block step vs float64."""
    rows = []
    for label, kernel, dtypes in paths:
        for dim in sizes.kernel_dims:
            for dtype in dtypes:
                n = min(sizes.kernel_len, 1024) if dtype == torch.float64 else sizes.kernel_len
                base = random_inputs(1, n, sizes.kernel_heads, sizes.kernel_kv_heads, dim, dtype, device, seed=dim)
                scale = dim ** -0.5
                for kind in KERNEL_CASES:
                    if sec.skip_for_time(f"{label} dim {dim} {DTYPE_NAMES[dtype]} {kind}", 2.0):
                        return rows
                    row = {"kernel": label, "dtype": DTYPE_NAMES[dtype], "head_dim": dim, "mask": kind,
                           "shape": f"{n} tok, {sizes.kernel_heads}/{sizes.kernel_kv_heads} heads"}
                    tensors, where = base, {}
                    if kind == "causal_striped":  # rank 0's queries and dO, rank 1's keys and values, G = 2
                        spec = MaskSpec(causal=True)
                        tensors = [base[0][:, 0::2], base[1][:, 1::2], base[2][:, 1::2], base[3][:, 0::2]]
                        where = {"q_segs": layout_mod.segments("striped", 0, 2, n // 2),
                                 "k_segs": layout_mod.segments("striped", 1, 2, n // 2)}
                    else:
                        spec = mask_spec(kind, n)
                    try:
                        mine, tiles = block_step(kernel, *tensors, spec, scale, max(n // 2, 1), **where)
                        positions = {f"{x}_pos": torch.cat([s.positions() for s in where[f"{x}_segs"]])
                                     for x in "qk"} if where else {}
                        ref = float64_reference(*tensors, spec, scale, **positions)
                        errors, ok = compare(mine, ref, DTYPE_NAMES[dtype])
                        row.update(errors, status="ok" if ok else "FAIL", tiles=tile_summary(kernel, tensors[0], tensors[1], tiles))
                        del mine, ref
                    except Exception as err:  # noqa: BLE001 - the row records it; the others still run
                        row.update(status="FAIL", tiles=f"raised {_first_line(err)}")
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
                            qq.transpose(1, 2), kk.repeat_interleave(group, 2).transpose(1, 2),
                            vv.repeat_interleave(group, 2).transpose(1, 2), is_causal=kind == "causal").transpose(1, 2)
                        out.backward(dout)
                    ref = float64_reference(q, k, v, dout, mask_spec(kind, n), dim ** -0.5)
                    errors, ok = compare((out, None, qq.grad, kk.grad, vv.grad), ref, dtype_name)
                    row.update(errors, status="ok" if ok else "over bound")  # torch's, not burst's: noted only
                    if not ok:
                        sec.note(f"torch SDPA {name} {dtype_name} {kind} is over burst.check's bound: {errors}")
                except RuntimeError as err:  # a backend that does not take this dtype / device: not ours
                    row.update(status="unsupported", note=_first_line(err)[:90])
                rows.append(row)
                release_memory(device)
    return rows


def section_kernels(rep: Report) -> None:
    with rep.section("1", "Exactness of every kernel path (block step vs float64)") as sec:
        sizes, device = rep.sizes, rep.device
        sec.note("burst selects per dtype: " + ", ".join(f"{d} -> {m}" for d, m in rep.facts["selected_kernels"].items())
                 + ". cuda_sdpa calls aten's memory-efficient SDPA op directly (the only SDPA op that returns lse "
                 "and takes the backward's lse); flash/cuDNN/math below are torch's SDPA, checked as the yardstick.")
        if device.type == "cuda" and not cuda_flash_attn.available():
            sec.note("flash_attn is not importable here: the cuda_flash_attn path did not run.")
        rows = kernel_rows(sec, device, sizes, kernel_paths(device, sizes))
        sec.table("block step vs float64 (errors relative to max |ref|, lse absolute)",
                  ["kernel", "dtype", "head_dim", "mask", "out", "lse", "dq", "dk", "dv", "bound", "status", "tiles"], rows)
        sec.table("torch SDPA backends vs float64 (no lse: SDPA returns none)",
                  ["backend", "dtype", "mask", "out", "dq", "dk", "dv", "status", "note"], sdpa_rows(sec, device, sizes))


# ---------------------------------------------------------------- 2. worlds


def _check_world(rank, world, sizes_dict, device_kind, strategies):
    """On every rank: burst.check plus the masks through burst.attention; rank 0's result returned."""
    sizes = Sizes(**sizes_dict)
    device = _rank_device(device_kind)
    report = burst.check(strategies=strategies, seq_len=sizes.world_len, heads=sizes.world_heads,
                         kv_heads=sizes.world_kv_heads, head_dim=sizes.world_dim, dtype=sizes.world_dtypes,
                         device=device)
    return {"check": report.as_dict(), "masks": masked_api_rows(None, world, device, sizes, strategies),
            "backend": dist.get_backend(), "device": str(device)}


def _probe_then_check(rank, world, sizes_dict, device_kind):
    """_probe_world, then, when every exchange came back right, _check_world in the same world."""
    probe = _probe_world(rank, world, device_kind)
    every = torch.tensor([float(all(probe.values()))], device=_rank_device(device_kind))
    dist.all_reduce(every, op=dist.ReduceOp.MIN)  # all ranks go on to the check, or none does
    check = _check_world(rank, world, sizes_dict, device_kind, None) if every.item() == 1.0 else None
    return {"probe": probe, "check": check}


def _rank_device(device_kind: str) -> torch.device:
    if device_kind == "cuda":
        torch.cuda.set_device(0)  # every rank of these worlds shares the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def masked_api_rows(group, world: int, device, sizes: Sizes, strategies=None) -> list:
    """window / documents / block-sparse through burst.attention, every strategy x layout, vs float64
    on the whole sequence (burst.check covers full and causal)."""
    n, rows = sizes.world_len, []
    for dtype_name in sizes.world_dtypes[:2]:
        dtype = getattr(torch, dtype_name)
        full = random_inputs(1, n, sizes.world_heads, sizes.world_kv_heads, sizes.world_dim, dtype, device, seed=7)
        for kind in ("window", "documents", "block_sparse"):
            spec = mask_spec(kind, n)
            ref = float64_reference(*full, spec, sizes.world_dim ** -0.5)
            for strategy in strategies or api.STRATEGIES:
                for lay in layout_mod.LAYOUTS:
                    row = {"strategy": strategy, "layout": lay, "mask": kind, "dtype": dtype_name}
                    q, k, v, dout = (layout_mod.shard(t, group=group, layout=lay) for t in full)
                    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                    try:
                        out, lse = burst.attention(q, k, v, group=group, strategy=strategy, layout=lay, return_lse=True,
                                                   **api_mask_kwargs(spec))
                    except (ValueError, NotImplementedError) as err:  # refused alike on every rank
                        row.update(status="skipped", note=_first_line(err)[:70])
                        rows.append(row)
                        continue
                    out.backward(dout)
                    theirs = [layout_mod.shard(t, group=group, layout=lay, dim=2 if t.dim() == 3 else 1) for t in ref]
                    errors, _ = compare((out, lse, q.grad, k.grad, v.grad), theirs, dtype_name)
                    worst = max_over_ranks([errors[x] for x in QUANTITIES], group, world, out.device)
                    errors = dict(zip(QUANTITIES, worst))
                    row.update(errors, status="ok" if reference.within_bounds(errors, dtype_name) else "FAIL")
                    rows.append(row)
    return rows


def _probe_world(rank, world, device_kind):
    """Can ranks sharing this device talk? Collectives, and a ring step through burst's own exchange
    (comm/p2p.py, which takes device tensors through host copies on gloo), on device tensors."""
    from burst.comm.p2p import exchange

    device = _rank_device(device_kind)
    x = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    done = {"all_reduce": float(x[0]) == world * (world + 1) / 2}
    gathered = [torch.empty(4, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((4,), float(rank), device=device))
    done["all_gather"] = [float(t[0]) for t in gathered] == [float(r) for r in range(world)]
    mine = torch.full((1024,), float(rank), device=device)
    got = exchange(None, "forward", [(mine, (rank + 1) % world, 0)], [(mine, (rank - 1) % world, 0)]).wait()[0]
    sync(device)
    done["exchange"] = got.device == device and float(got[0]) == float((rank - 1) % world)
    return done


def _world_table(sec: Section, label: str, result: dict) -> None:
    check_rows = [{**{k: r[k] for k in ("strategy", "layout", "causal", "dtype", "status", "note")}, **r["errors"]}
                  for r in result["check"]["rows"]]
    bad = [r for r in check_rows + result["masks"] if r["status"] == "FAIL"]
    ran = [r for r in check_rows + result["masks"] if r["status"] == "ok"]
    sec.note(f"{label}: backend {result['backend']}, tensors on {result['device']}: {len(ran)} cases within bounds, "
             f"{len(bad)} FAIL, {len(check_rows) + len(result['masks']) - len(ran) - len(bad)} skipped (refused by the strategy)")
    for r in bad:
        sec.fail(f"{label}: {r['strategy']} {r['layout']} {r.get('causal', r.get('mask'))} {r['dtype']}")
    cols = ["strategy", "layout", "dtype", "out", "lse", "dq", "dk", "dv", "status", "note"]
    sec.table(f"{label}: burst.check (full and causal)", cols[:2] + ["causal"] + cols[2:], check_rows)
    sec.table(f"{label}: masks through burst.attention", cols[:2] + ["mask"] + cols[2:], result["masks"])


def section_worlds(rep: Report) -> dict:
    """Returns {"backend": the backend that ran several ranks on this device, or None}."""
    found = {"backend": None}
    with rep.section("2", "The whole API on one rank, then several ranks on one device") as sec:
        sizes, kind = rep.sizes, rep.device.type
        one = "nccl" if kind == "cuda" else "gloo"
        result = spawn_world(_check_world, dataclasses.asdict(sizes), kind, None, nproc=1, backend=one, threads=sizes.threads,
                             timeout=min(sec.left(), sizes.spawn_timeout * 2))
        _world_table(sec, f"1 rank ({one})", result[0])
        candidates = ["nccl", "gloo"] if kind == "cuda" else ["gloo"]
        tried, first = [], sizes.world_ranks[0]
        for backend in candidates:  # NCCL refuses two ranks on one GPU; gloo may take CUDA tensors
            if sec.skip_for_time(f"probe {backend} with {first} ranks", 30):
                break
            try:
                limit = 90.0 if backend == "nccl" else sizes.spawn_timeout * 2  # NCCL is expected to refuse: fast
                got = spawn_world(_probe_then_check, dataclasses.asdict(sizes), kind, nproc=first, backend=backend,
                                  threads=sizes.threads, timeout=max(10.0, min(limit, sec.left())))[0]
                tried.append({"backend": backend, "ranks": first, "tensors": kind, **got["probe"], "result": "ran"})
            except Exception as err:  # noqa: BLE001 - the probe is there to find out
                tried.append({"backend": backend, "ranks": first, "tensors": kind, "result": _first_line(err)[:160]})
                continue
            if got["check"] is not None:
                found["backend"] = backend
                sec.note(f"several ranks on one device run with {backend}: communication is copies on the device "
                         "(with gloo, through host memory: comm/p2p.py), not a network")
                _world_table(sec, f"{first} ranks ({backend})", got["check"])
                break
        sec.table("several ranks on one device: what the backends took (exchange = burst.comm.p2p's isend/irecv)",
                  ["backend", "ranks", "tensors", "all_reduce", "all_gather", "exchange", "result"], tried)
        if found["backend"] is None:
            sec.note(f"no backend ran {first} ranks on one {kind} device with {kind} tensors (see the table); the "
                     "several-rank checks did not run")
            return found
        for ranks in sizes.world_ranks[1:]:
            if sec.skip_for_time(f"{ranks} ranks", 20):
                break
            result = spawn_world(_check_world, dataclasses.asdict(sizes), kind, None, nproc=ranks, threads=sizes.threads,
                                 backend=found["backend"], timeout=min(sec.left(), sizes.spawn_timeout * 2))
            _world_table(sec, f"{ranks} ranks ({found['backend']})", result[0])
    return found


# ---------------------------------------------------------------- 3. speed


def time_fwd_bwd(device, repeats: int, forward, backward, reset) -> tuple[float, float]:
    """Best forward and backward seconds over `repeats` passes after one warm-up pass (the bench's
    own timing loop)."""
    from .harness import _time_passes

    fwd_s, bwd_s, _ = _time_passes(repeats, device, forward, backward, reset)
    return fwd_s, bwd_s


def sdpa_runner(q, k, v, dout, causal: bool, device):
    """torch SDPA on (batch, seq, heads, dim) tensors, pinned to its flash backend on CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    dt = dout.transpose(1, 2)
    backends = [SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

    def forward():
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def reset():
        qt.grad = kt.grad = vt.grad = None

    return forward, lambda out: out.backward(dt), reset


def block_step_runner(q, k, v, dout, causal: bool, device):
    """The whole sequence as one block pair through the block step, tiles of the kernel's call size."""
    kernel = select_kernel(device, q.dtype)
    segs = [Segment(0, q.shape[1], 0)]
    tiles = plan_tiles(segs, segs, MaskSpec(causal=causal), TileSizes(kernel.MAX_ROWS))
    scale = q.shape[-1] ** -0.5
    state = {}

    def forward():
        out_acc, lse = empty_accumulators(q)
        attend_forward(kernel, q, k, v, tiles, out_acc, lse, scale)
        state["lse"] = lse
        return out_acc.to(q.dtype)

    def backward(out):
        grads = [accumulator_zeros_like(t) for t in (q, k, v)]
        attend_backward(kernel, dout, q, k, v, None, lse_for_backward(state.pop("lse")), tiles, *grads, scale,
                        delta=row_delta(dout, out))

    return forward, backward, lambda: None


def attention_runner(q, k, v, dout, causal: bool, device):
    """burst.attention on one process (no group): the strategy, its autograd and the block step."""
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

    def reset():
        qq.grad = kk.grad = vv.grad = None

    return lambda: burst.attention(qq, kk, vv, causal=causal), lambda out: out.backward(dout), reset


RUNNERS = {"sdpa": sdpa_runner, "block_step": block_step_runner, "burst.attention": attention_runner}


def measure(name: str, inputs, causal: bool, device, repeats: int) -> dict:
    """Best fwd and bwd seconds of runner `name` on inputs q, k, v, dout (batch 1, MHA), and TFLOP/s."""
    q = inputs[0]
    fwd_s, bwd_s = time_fwd_bwd(device, repeats, *RUNNERS[name](*inputs, causal, device))
    fwd_flops, bwd_flops = attention_flops(BenchConfig(seq_len=q.shape[1], heads=q.shape[2], head_dim=q.shape[3],
                                                       causal=causal))
    return {"fwd_s": fwd_s, "bwd_s": bwd_s, "tflops": (fwd_flops + bwd_flops) / (fwd_s + bwd_s) / 1e12}


def _bench_rank(rank, world, runs, device_kind):
    """harness.run_strategy for each (config, strategy) of `runs` on this world; this rank's results."""
    _rank_device(device_kind)
    return [run_strategy(BenchConfig(**cfg), strategy, rank, world) for cfg, strategy in runs]


def section_speed(rep: Report, several: str | None) -> None:
    with rep.section("3", "Speed: block step and one-rank burst.attention vs torch SDPA") as sec:
        sizes, device = rep.sizes, rep.device
        dtype = getattr(torch, sizes.speed_dtype)
        sec.note(f"{sizes.speed_dtype}, batch 1, heads x head_dim = {sizes.speed_hidden}, MHA; TFLOP/s counts "
                 "4*heads*dim per attended pair forward, 2.5x that backward (harness.attention_flops); "
                 "'x SDPA' = SDPA's fwd+bwd time / this one's (> 1: faster than SDPA)"
                 + ("; SDPA pinned to its flash backend" if device.type == "cuda" else "; SDPA on the CPU"))
        rows, last = [], {}
        for n in sizes.speed_lens:  # every setting at one length before any at the next: time runs out at the longest
            for dim in sizes.speed_dims:
                for causal in (False, True):
                    if sec.skip_for_time(f"dim {dim} causal={causal} at {n} tokens", 4.5 * last.get((dim, causal), 0) + 1):
                        continue
                    began = time.monotonic()
                    heads = max(1, sizes.speed_hidden // dim)
                    row = {"head_dim": dim, "heads": heads, "causal": causal, "tokens": n}
                    inputs = random_inputs(1, n, heads, heads, dim, dtype, device, on_device=True)
                    for name in RUNNERS:
                        try:
                            got = measure(name, inputs, causal, device, sizes.speed_repeats)
                            row[f"{name} TFLOP/s"] = got["tflops"]
                            row[f"{name} s"] = got["fwd_s"] + got["bwd_s"]
                        except Exception as err:  # noqa: BLE001 - OOM or a kernel error: noted, the rest runs
                            row[f"{name} s"] = "OOM" if is_oom(err) else type(err).__name__
                            if not is_oom(err):
                                sec.fail(f"{name} at {n} tokens dim {dim}: {_first_line(err)}")
                        release_memory(device)
                    del inputs
                    for name in ("block_step", "burst.attention"):
                        if isinstance(row.get(f"{name} s"), float) and isinstance(row.get("sdpa s"), float):
                            row[f"{name} x SDPA"] = row["sdpa s"] / row[f"{name} s"]
                    rows.append(row)
                    last[(dim, causal)] = time.monotonic() - began
        rows.sort(key=lambda r: (r["head_dim"], r["causal"], r["tokens"]))
        cols = ["head_dim", "heads", "causal", "tokens"]
        for name in RUNNERS:
            cols += [f"{name} s", f"{name} TFLOP/s"] + ([f"{name} x SDPA"] if name != "sdpa" else [])
        sec.table("one device, fwd+bwd (s = forward + backward seconds)", cols, rows)
        if several is None:
            sec.note("no several-rank world ran on this device (section 2), so no several-rank timing")
            return
        if sec.skip_for_time("the several-rank timing", 30):
            return
        ranks = sizes.world_ranks[0]
        runs = []
        for causal in (False, True):
            cfg = BenchConfig(seq_len=sizes.world_speed_len, heads=max(1, sizes.speed_hidden // 128),
                              head_dim=min(128, sizes.speed_hidden), dtype=sizes.speed_dtype, causal=causal,
                              layout="zigzag" if causal else "contiguous", nproc=ranks, repeats=sizes.speed_repeats)
            runs += [(dataclasses.asdict(cfg), strategy) for strategy in ("burst", "ring")]
        per_rank = spawn_world(_bench_rank, runs, device.type, nproc=ranks, backend=several, threads=sizes.threads,
                               timeout=max(10.0, min(sec.left(), sizes.spawn_timeout)))
        world_rows = []
        for i, (cfg_dict, strategy) in enumerate(runs):
            cfg, mine = BenchConfig(**cfg_dict), [r[i] for r in per_rank]
            fwd_flops, bwd_flops = attention_flops(cfg)
            secs = max(r["fwd_s"] for r in mine) + max(r["bwd_s"] for r in mine)
            world_rows.append({"strategy": strategy, "ranks": ranks, "causal": cfg.causal, "layout": cfg.layout,
                               "tokens": cfg.seq_len, "s": secs, "TFLOP/s (all ranks)": (fwd_flops + bwd_flops) / secs / 1e12,
                               "peak MiB/rank": max(r["peak_mem_bytes"] for r in mine) / 2**20,
                               "max err": max(r["max_err"] for r in mine)})
        sec.note(f"{ranks} ranks share one device over {several}: their communication is copies on one device "
                 "(through host memory with gloo) and they share its compute: not a multi-GPU number")
        sec.table(f"{ranks} ranks on one device (harness.run_strategy)", ["strategy", "ranks", "causal", "layout", "tokens",
                  "s", "TFLOP/s (all ranks)", "peak MiB/rank", "max err"], world_rows)


# ---------------------------------------------------------------- 4. memory


def longest(fits, start: int, limit: int, granularity: int, deadline: float, note, label: str) -> dict:
    """The longest length (a multiple of `granularity`) for which fits(n) is True: doubling from
    `start`, then bisecting, each trial only while the deadline allows (a trial at twice the length
    is taken to cost 4.5x the last one). fits(n): True, or False for out of memory; an error raised
    ends the search and is recorded. Returns the bracket and what stopped the search."""
    good, bad, last_s, why, n = None, None, 0.0, "limit", start

    def trial(n):
        nonlocal last_s
        began = time.monotonic()
        ok = fits(n)
        if ok:
            last_s = time.monotonic() - began
        return ok

    try:
        while n <= limit:
            if deadline - time.monotonic() < 4.5 * last_s + 2:
                why = "time"
                break
            if not trial(n):
                bad, why = n, "memory"
                break
            good, n = n, n * 2
        while why == "memory" and good is not None and bad - good > granularity:
            mid = (good + bad) // 2 // granularity * granularity
            if mid <= good:
                break
            if deadline - time.monotonic() < 2.5 * last_s + 2:
                why = "memory, bisection cut by time"
                break
            if trial(mid):
                good = mid
            else:
                bad = mid
    except Exception as err:  # noqa: BLE001 - a failure that is not out-of-memory: recorded, search over
        why = f"error at {n}: {_first_line(err)[:150]}"
    note(f"{label}: longest that ran {good}, shortest that did not {bad} (search stopped by {why})")
    return {"what": label, "fits": good, "does not fit": bad, "stopped by": why}


def memory_trial(device: torch.device, cap: int | None, run) -> tuple[bool, int]:
    """Run `run()` once; (fit, peak bytes above what was allocated before). On CUDA fit = no
    torch.cuda.OutOfMemoryError; on the CPU fit = peak RSS growth under `cap` (no OOM to hit)."""
    from burst.bench.memory import held_bytes, peak_bytes, reset_peak

    release_memory(device)
    reset_peak(device)
    base = held_bytes(device)
    out_of_memory = False
    try:
        run()
        sync(device)
    except Exception as err:  # noqa: BLE001
        if not is_oom(err):
            raise
        out_of_memory = True  # freed below, once the exception (and the tensors its frames hold) is gone
    if out_of_memory:
        release_memory(device)
        return False, -1
    peak = peak_bytes(device) - base
    release_memory(device)
    return (cap is None or peak <= cap), peak


def fwd_bwd_once(name: str, n: int, sizes: Sizes, device) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, dout = random_inputs(sizes.mem_batch, n, sizes.mem_heads, sizes.mem_heads, sizes.mem_dim, dtype, device,
                                  on_device=True)
    forward, backward, _ = RUNNERS[name](q, k, v, dout, True, device)
    backward(forward())


def train_steps(sizes: Sizes, device, mode: str, n: int, steps: int = 2, model=None) -> dict:
    """The engine's model (engine/train.build, or `model` as given: FSDP2-sharded) on this device under
    bf16 autocast, `steps` AdamW steps at n tokens with checkpointing `mode`. `burst train` itself
    places nothing on a device (the model stays on the CPU), so the steps are driven here as
    engine/train.train_step does."""
    from burst.engine.train import TokenSource, TrainConfig, build

    cfg = TrainConfig(model=sizes.train_model, seq_len=n, steps=steps, checkpointing=mode, progress=False)
    model = build(cfg).to(device) if model is None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data = TokenSource(cfg, model.cfg.vocab_size)
    positions = torch.arange(n, device=device).expand(cfg.batch, -1)
    losses, began = [], time.perf_counter()
    for step in range(steps):
        tokens = data.batch(step).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], positions, targets=tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    sync(device)
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"non-finite loss {losses} at {n} tokens, checkpointing {mode}")
    return {"losses": losses, "s_per_step": (time.perf_counter() - began) / steps}


def section_memory(rep: Report, several: str | None) -> None:
    with rep.section("4", "Memory: longest fwd+bwd, peak per rank, training length per checkpointing mode") as sec:
        sizes, device = rep.sizes, rep.device
        shape = (f"batch {sizes.mem_batch} x {sizes.mem_heads} heads x dim {sizes.mem_dim}, causal, "
                 + ("bf16" if device.type == "cuda" else "float32"))
        sec.note(f"longest fwd+bwd at {shape}; " + ("ran = no torch.cuda.OutOfMemoryError on the whole GPU"
                 if device.type == "cuda" else f"CPU mode: ran = peak RSS growth under {sizes.mem_cap_bytes >> 20} MiB"))
        found, peaks = [], {}
        for i, name in enumerate(("sdpa", "burst.attention")):
            def fits(n, name=name):
                ok, peak = memory_trial(device, sizes.mem_cap_bytes, lambda: fwd_bwd_once(name, n, sizes, device))
                if ok:
                    peaks[(name, n)] = peak
                return ok

            deadline = time.monotonic() + sec.left() * (0.3 if i == 0 else 0.45)
            found.append(longest(fits, sizes.mem_start, sizes.mem_limit, max(sizes.mem_start // 2, 1), deadline,
                                 sec.note, f"{name} at one rank"))
        sec.table(f"longest sequence, fwd+bwd, one rank ({shape})", ["what", "fits", "does not fit", "stopped by"], found)
        common = [n for (name, n) in peaks if name == "sdpa" and ("burst.attention", n) in peaks]
        if common and device.type == "cuda":  # RSS growth at the CPU's tiny sizes says nothing
            n = max(common)
            sec.note(f"peak above the inputs at {n} tokens: burst.attention {peaks[('burst.attention', n)] / 2**20:.0f} "
                     f"MiB, SDPA {peaks[('sdpa', n)] / 2**20:.0f} MiB "
                     f"({peaks[('burst.attention', n)] / max(peaks[('sdpa', n)], 1):.2f}x)")
        _peak_per_rank(sec, sizes, device, several)
        _train_lengths(sec, sizes, device)


def _peak_per_rank(sec: Section, sizes: Sizes, device, several: str | None) -> None:
    """burst's peak per rank on G ranks sharing the device against 1/G of its peak on one rank."""
    if several is None:
        sec.note("peak per rank vs the 1/G share: no several-rank world ran on this device (section 2)")
        return
    if sec.skip_for_time("peak per rank vs the 1/G share", 40):
        return
    cfg = BenchConfig(seq_len=sizes.world_speed_len, heads=sizes.mem_heads, head_dim=sizes.mem_dim,
                      dtype=sizes.speed_dtype, causal=True, layout="zigzag", repeats=0, check_rows=8)
    one = run_strategy(cfg, "burst", 0, 1)["peak_mem_bytes"]  # this process, no group
    rows = [{"ranks": 1, "tokens": cfg.seq_len, "peak MiB/rank": one / 2**20, "1/G share MiB": one / 2**20, "x share": 1.0}]
    for ranks in sizes.world_ranks:
        if sec.skip_for_time(f"peak per rank at {ranks} ranks", 20):
            break
        per_rank = spawn_world(_bench_rank, [(dataclasses.asdict(dataclasses.replace(cfg, nproc=ranks)), "burst")],
                               device.type, nproc=ranks, backend=several, threads=sizes.threads, timeout=max(10.0, min(sec.left(), sizes.spawn_timeout)))
        peak = max(r[0]["peak_mem_bytes"] for r in per_rank)
        rows.append({"ranks": ranks, "tokens": cfg.seq_len, "peak MiB/rank": peak / 2**20,
                     "1/G share MiB": one / ranks / 2**20, "x share": peak / (one / ranks)})
    sec.table("burst.attention peak memory per rank vs the 1/G share of one rank's (inputs included)",
              ["ranks", "tokens", "peak MiB/rank", "1/G share MiB", "x share"], rows)


def _train_lengths(sec: Section, sizes: Sizes, device) -> None:
    from burst.engine.checkpointing import MODES

    sec.note("the engine on one device attends with torch SDPA (SequenceAttention at world 1); remat and "
             "selective replay the stored output through burst's single-device strategy and kernels")
    rows, stats = [], {}
    for i, mode in enumerate(MODES):
        def fits(n, mode=mode):
            box = {}
            ok, peak = memory_trial(device, None, lambda: box.update(train_steps(sizes, device, mode, n)))
            if ok:
                stats[(mode, n)] = {**box, "peak": peak}
            return ok

        deadline = time.monotonic() + sec.left() / (len(MODES) - i)
        got = longest(fits, sizes.train_start, sizes.train_limit, max(sizes.train_start // 2, 1), deadline, sec.note,
                      f"{sizes.train_model} model, checkpointing {mode}")
        best = stats.get((mode, got["fits"]), {})
        rows.append({"checkpointing": mode, "longest trained": got["fits"], "did not fit": got["does not fit"],
                     "stopped by": got["stopped by"], "peak MiB": best["peak"] / 2**20 if best else None,
                     "s/step": best.get("s_per_step"), "losses": ", ".join(f"{x:.3f}" for x in best.get("losses", []))})
        if got["stopped by"].startswith("error"):
            sec.fail(f"training with checkpointing {mode}: {got['stopped by']}")
    sec.table(f"engine '{sizes.train_model}' model, 2 AdamW steps under bf16 autocast, one device, tokens per sequence",
              ["checkpointing", "longest trained", "did not fit", "stopped by", "peak MiB", "s/step", "losses"], rows)


# ---------------------------------------------------------------- 5. CUDA-only features


def _fsdp_world(rank, world, sizes_dict, device_kind):
    """FSDP2 CPU offload on a one-rank world: first through `burst train`'s own entry point
    (engine.train.train), then through the engine's pieces (engine.parallel.shard_parameters over an
    explicit (dp, sp) mesh) with the model's steps on this device. On the CPU offload is refused by
    design, so there the second runs FSDP2 without it. Returns feature rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from burst.engine.parallel import Parallel, shard_parameters
    from burst.engine.train import TrainConfig, build, train

    sizes, device = Sizes(**sizes_dict), _rank_device(device_kind)
    rows = []
    cfg = TrainConfig(model="tiny", seq_len=256, steps=2, fsdp="dp", cpu_offload=True, progress=False)
    feature = "burst train --fsdp dp --cpu-offload on 1 rank (engine.train.train)"
    try:
        got = train(rank, world, cfg)
        rows.append({"feature": feature, "status": "ok", "detail": "losses " + ", ".join(f"{r['loss']:.3f}" for r in got)})
    except Exception as err:  # noqa: BLE001 - recorded
        refused = device_kind == "cpu" and isinstance(err, ValueError)
        rows.append({"feature": feature, "status": "refused on CPU (as designed)" if refused else "FAIL",
                     "detail": _first_line(err)[:200]})
    offload = device_kind == "cuda"
    feature = f"engine model, FSDP2 over a (1, 1) mesh{', CPU offload' if offload else ''}, steps on {device_kind}"
    try:
        mesh = init_device_mesh(device_kind, (1, 1), mesh_dim_names=("dp", "sp"))
        tcfg = TrainConfig(model=sizes.train_model, seq_len=sizes.train_start, progress=False)
        model = shard_parameters(build(tcfg), Parallel(fsdp="dp", mesh=mesh), cpu_offload=offload)
        if not offload:
            model.to(device)
        where = next(model.parameters()).device
        got = train_steps(sizes, device, "none", sizes.train_start, model=model)
        peak = torch.cuda.max_memory_allocated() / 2**20 if offload else None
        kept_on_host = where.type == "cpu"  # what offload promises; without it they follow the model
        rows.append({"feature": feature, "status": "ok" if kept_on_host or not offload else "FAIL",
                     "detail": f"parameters on {where}; losses " + ", ".join(f"{x:.3f}" for x in got["losses"])
                     + (f"; GPU peak {peak:.0f} MiB" if peak is not None else "")})
    except Exception as err:  # noqa: BLE001 - recorded
        rows.append({"feature": feature, "status": "FAIL", "detail": _first_line(err)[:200]})
    return rows


def section_features(rep: Report) -> None:
    with rep.section("5", "CUDA-only features: FSDP2 CPU offload, bf16 autocast, burst check") as sec:
        sizes, device = rep.sizes, rep.device
        rows = []
        for what, need, feature in (("FSDP2 CPU offload", 40, _fsdp_rows), ("bf16 autocast", 2, _autocast_rows),
                                    ("burst check", 30, _cli_rows)):
            if sec.skip_for_time(what, need):
                continue
            try:
                rows += feature(sec, sizes, device, rep.outdir)
            except Exception as err:  # noqa: BLE001 - recorded; the next feature still runs
                rows.append({"feature": what, "status": "FAIL", "detail": _first_line(err)[:200]})
        for row in rows:
            if row["status"] == "FAIL":
                sec.fail(f"{row['feature']}: {row['detail']}")
        import inspect

        from burst.launch import run_world

        if device.type == "cuda" and inspect.signature(run_world).parameters["backend"].default == "gloo":
            sec.note("burst check starts its world with launch.run_world's default backend, gloo, and burst.check "
                     "puts tensors on the CPU for a gloo group: as shipped, `burst check` checks the CPU path even "
                     "on a GPU machine (section 2 runs burst.check on NCCL and CUDA instead)")
        sec.table("features", ["feature", "status", "detail"], rows)


def _fsdp_rows(sec: Section, sizes: Sizes, device, outdir) -> list:
    """FSDP2 CPU offload on a one-rank world (_fsdp_world)."""
    return spawn_world(_fsdp_world, dataclasses.asdict(sizes), device.type, nproc=1, threads=sizes.threads,
                       backend="nccl" if device.type == "cuda" else "gloo",
                       timeout=max(10.0, min(sec.left(), sizes.spawn_timeout)))[0]


def _autocast_rows(sec: Section, sizes: Sizes, device, outdir) -> list:
    """float32 q, k, v under torch.autocast(bf16): burst.attention runs in bf16, as SDPA does."""
    n = sizes.world_len
    q, k, v, dout = random_inputs(1, n, sizes.world_heads, sizes.world_kv_heads, sizes.world_dim, torch.float32,
                                  device, seed=3)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out, lse = burst.attention(qq, kk, vv, causal=True, return_lse=True)
    out.float().backward(dout)
    as_bf16 = [t.to(torch.bfloat16) for t in (q, k, v, dout)]
    errors, ok = compare((out, lse, qq.grad, kk.grad, vv.grad),
                         float64_reference(*as_bf16, MaskSpec(causal=True), sizes.world_dim ** -0.5), "bfloat16")
    ok = ok and out.dtype == torch.bfloat16 and qq.grad.dtype == torch.float32
    return [{"feature": "burst.attention under torch.autocast(bf16)", "status": "ok" if ok else "FAIL",
             "detail": f"out {out.dtype}, dq {qq.grad.dtype}; errors " + ", ".join(f"{x} {e:.1e}" for x, e in errors.items())}]


def _cli_rows(sec: Section, sizes: Sizes, device, outdir) -> list:
    """`burst check` as a user runs it, in a subprocess."""
    command = [sys.executable, "-m", "burst", "check", "--nproc", "1", "--seq-len", str(min(sizes.world_len, 1024)),
               "--heads", str(sizes.world_heads), "--head-dim", str(sizes.world_dim), "--dtype", "float32,bfloat16",
               "--strategies", "burst,ring,allgather", "--json", os.path.join(outdir, "burst_check.json")]
    feature = "`" + " ".join(["python -m burst"] + command[3:-2]) + "`"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(10.0, min(sec.left(), 150)),
                              env={**os.environ, "PYTHONPATH": _repo_root()})
    except subprocess.TimeoutExpired:
        return [{"feature": feature, "status": "FAIL", "detail": "timed out"}]
    text = (done.stdout + done.stderr).strip()
    detail = f"exit {done.returncode}: " + (text.splitlines()[-1][:200] if text else "")
    if done.returncode:
        sec.note(f"burst check output: {text[-500:]}")
    return [{"feature": feature, "status": "ok" if done.returncode == 0 else "FAIL", "detail": detail}]


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


# ---------------------------------------------------------------- entry point


def run(outdir: str, device: torch.device | None = None, budget: float | None = None) -> dict:
    """Every section on `device` (default: CUDA when available, else CPU; BURST_DEVICE overrides);
    writes outdir/report.md and report.json; returns the report as a dict."""
    if device is None:
        wanted = os.environ.get("BURST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(wanted)
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    budget = budget if budget is not None else sum(sizes.budgets.values())
    if device.type == "cuda":
        torch.cuda.set_device(0)
    if sizes.threads:
        torch.set_num_threads(sizes.threads)
    rep = Report(outdir, device, budget, sizes)
    rep.write()
    section_kernels(rep)
    several = section_worlds(rep)["backend"]
    section_speed(rep, several)
    section_memory(rep, several)
    section_features(rep)
    rep.write()
    return rep.as_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m burst.bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", help="where report.md and report.json are written")
    p.add_argument("--budget", type=float, default=None, help="global deadline in seconds (default: the sections' sum)")
    args = p.parse_args(argv)
    data = run(args.outdir, budget=args.budget)
    print(f"gpu_check: {'all sections ok' if data['ok'] else 'NOT all ok'}; report in {args.outdir}/report.md")
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
