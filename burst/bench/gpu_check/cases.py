"""What the GPU check runs: sizes per device, the mask kinds, inputs, the float64 reference, the
block step through the planner and kernels, and the device helpers every section shares.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass

import torch

from burst.kernels import aten_flash, cuda_flash_attn, cuda_sdpa, cudnn, flex, lse_for_backward, reference, row_delta
from burst.kernels.accumulators import accumulator_zeros_like, empty_accumulators
from burst.kernels.attend import attend_backward, attend_forward
from burst.layout import Segment
from burst.masks import Bands, BlockSparseMask, MaskSpec, PositionRule, TileSizes, plan_tiles

MASK_KINDS = ("full", "causal", "window", "documents", "documents_window", "block_sparse")


# Section 1 also runs striped causal across ranks: rank 0's queries (positions 0, 2, ...) against rank
# 1's keys (1, 3, ...), j < i, which the planner turns into an (n-1) x (n-1) causal tile (odd sizes,
# unaligned strides) and whose first query attends nothing (an empty row).
KERNEL_CASES = MASK_KINDS + ("causal_striped",)


DTYPE_NAMES = {dtype: name for name, dtype in reference.DTYPES.items()}


@dataclass
class Sizes:
    """Every size the check uses; CUDA and CPU differ only here."""

    kernel_len: int  # tokens in section 1's block step (split into tiles of kernel_len // 2)
    kernel_heads: int
    kernel_kv_heads: int
    kernel_dims: tuple
    kernel_dtypes: tuple  # half/single precisions tried on each kernel path
    world_len: int  # global tokens in section 2's worlds
    world_heads: int
    world_kv_heads: int
    world_dim: int
    world_dtypes: tuple
    world_ranks: tuple  # several ranks on one device
    speed_lens: tuple
    speed_dims: tuple
    speed_hidden: int  # heads x head_dim in section 3
    speed_dtype: str
    speed_repeats: int
    world_speed_len: int  # section 3's several-rank run
    ref_lens: tuple  # section 7: tokens, the most telling first (a short budget runs those)
    ref_heads: int  # section 7: query heads (KV heads a quarter of them, or as many), head dim 128
    mem_batch: int  # section 4's longest-length search: batch x heads x head_dim
    mem_heads: int
    mem_dim: int
    mem_start: int
    mem_limit: int
    mem_cap_bytes: int | None  # CPU mode: "fits" = peak RSS growth under this (no OOM on a CPU)
    train_model: str
    train_start: int
    train_limit: int
    budgets: dict  # seconds per section
    spawn_timeout: float
    threads: int | None  # torch threads per process (None: torch's default)
    kernel_names: tuple = ()  # section 1's kernel paths by name (empty: every one burst selects here)


CUDA_SIZES = Sizes(
    kernel_len=4096,
    kernel_heads=8,
    kernel_kv_heads=2,
    kernel_dims=(64, 128),
    kernel_dtypes=("float32", "float16", "bfloat16"),
    world_len=4096,
    world_heads=8,
    world_kv_heads=2,
    world_dim=128,
    world_dtypes=("float32", "bfloat16", "float16"),
    world_ranks=(2, 4),
    speed_lens=(8192, 16384, 32768, 65536, 131072),
    speed_dims=(64, 128),
    speed_hidden=2048,
    speed_dtype="bfloat16",
    speed_repeats=1,
    ref_lens=(65536, 16384, 131072, 32768),
    ref_heads=32,
    world_speed_len=16384,  # 2 ranks sharing the GPU through gloo's host copies did not finish 32768 in the time left
    # batch 1 and at most 2^18 tokens: under 2^31 elements per tensor (on the H200 torch's own SDPA hit an illegal
    # memory access at 8 x 32 x 128 x 131072 = 2^32, which poisons the CUDA context for every later section)
    mem_batch=1,
    mem_heads=32,
    mem_dim=128,
    mem_start=8192,
    mem_limit=1 << 18,
    mem_cap_bytes=None,
    train_model="small",
    train_start=65536,
    train_limit=1 << 20,
    budgets={"1": 40, "2": 90, "3": 100, "4": 50, "5": 40, "6": 90, "7": 360},
    spawn_timeout=120.0,
    threads=None,
)


CPU_SIZES = Sizes(
    kernel_len=128,
    kernel_heads=2,
    kernel_kv_heads=1,
    kernel_dims=(16,),
    kernel_dtypes=("float32", "bfloat16"),
    world_len=32,
    world_heads=2,
    world_kv_heads=1,
    world_dim=16,
    world_dtypes=("float32",),
    world_ranks=(2,),
    speed_lens=(128, 256),
    speed_dims=(16,),
    speed_hidden=32,
    speed_dtype="float32",
    speed_repeats=1,
    world_speed_len=128,
    ref_lens=(256, 128),
    ref_heads=4,
    mem_batch=1,
    mem_heads=2,
    mem_dim=16,
    mem_start=128,
    mem_limit=512,
    mem_cap_bytes=256 << 20,
    train_model="tiny",
    train_start=32,
    train_limit=64,
    budgets={"1": 30, "2": 60, "3": 20, "4": 30, "5": 40, "6": 40, "7": 30},
    spawn_timeout=60.0,
    threads=1,  # tiny ops: one thread each is many times faster than threads spinning on a busy machine
)


def release_memory(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks back (after an OOM, between sizes); nothing on CPU."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    """A CUDA out-of-memory (torch.cuda.OutOfMemoryError), or a host allocation failure."""
    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(err).lower()


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
    if kind == "documents_window":  # varlen tiles with a one-sided window: FlashAttention-2 fills its other side in
        return MaskSpec(causal=True, window=(n // 16, 0), cu_seqlens=(0, n // 3 + 1, n // 2 + 5, n))
    if kind == "block_sparse":
        blocks = 8
        g = torch.Generator().manual_seed(seed + 2)
        grid = (torch.rand(blocks, blocks, generator=g) < 0.4) | torch.eye(blocks, dtype=torch.bool)
        return MaskSpec(block_sparse=BlockSparseMask(n // blocks, grid))
    raise ValueError(f"mask kind must be one of {MASK_KINDS}, got {kind!r}")


def api_mask_kwargs(spec: MaskSpec) -> dict:
    return {
        "causal": spec.causal,
        "window": spec.window,
        "cu_seqlens": spec.cu_seqlens,
        "block_sparse": spec.block_sparse,
    }


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


def block_step(kernel, q, k, v, dout, spec: MaskSpec, scale: float, max_rows: int, q_segs=None, k_segs=None):
    """One block pair through the block step, as the strategies run it: tiles planned by
    masks.plan_tiles, merged forward, BurstAttention's delta backward. q_segs / k_segs: the global
    positions the blocks hold (layout.Segment runs; default the whole sequence)."""
    q_segs = q_segs or [Segment(0, q.shape[1], 0)]
    k_segs = k_segs or [Segment(0, k.shape[1], 0)]
    tiles = plan_tiles(q_segs, k_segs, spec, TileSizes.for_kernel(kernel, max_rows))
    out_acc, lse = empty_accumulators(q)
    attend_forward(kernel, q, k, v, tiles, out_acc, lse, scale)
    out = out_acc.to(q.dtype)
    del out_acc
    dq, dk, dv = accumulator_zeros_like(q), accumulator_zeros_like(k), accumulator_zeros_like(v)
    attend_backward(
        kernel, dout, q, k, v, None, lse_for_backward(lse), tiles, dq, dk, dv, scale, delta=row_delta(dout, out)
    )
    return (out, lse, dq, dk, dv), tiles


def tile_backend(kernel, q, k, tile) -> str:
    """Which function serves `tile` on `kernel` and how its mask travels: +band / +varlen (flash_attn's
    window or varlen arguments), +rule (FlexAttention's mask_mod), +mask (a dense bias)."""
    name = getattr(kernel, "__name__", str(kernel)).rsplit(".", 1)[-1]
    mask = tile.kernel_mask
    if kernel is cudnn:
        qt, kt = q[:, tile.q.rows], k[:, tile.k.rows]
        if cudnn.handles(qt, kt, kt, tile.causal, mask):
            return "cudnn" + (" causal" if tile.causal else " reversed" if mask is not None else "")
        kernel = aten_flash  # what cudnn hands masked tiles to
    if kernel in (cuda_flash_attn, aten_flash):
        qt, kt = q[:, tile.q.rows], k[:, tile.k.rows]
        if kernel.handles(qt, kt, tile.causal, mask):
            name = "flash_attn" if kernel is cuda_flash_attn else "aten_flash"
        else:
            name = "flex" if kernel._fallback(mask) is flex else "cuda_sdpa(efficient)"
    elif kernel is cuda_sdpa:
        name = "cuda_sdpa(efficient)"
    if isinstance(mask, Bands):
        how = "+varlen" if mask.sequences > 1 else "+band"
    elif isinstance(mask, PositionRule):
        how = "+rule" if name == "flex" else "+mask"
    else:
        how = "+mask" if mask is not None else ""
    return name + how + (" causal" if tile.causal else "")


def tile_summary(kernel, q, k, tiles) -> str:
    counts = Counter(f"{t.cover.name} {t.q.length}x{t.k.length} -> {tile_backend(kernel, q, k, t)}" for t in tiles)
    return "; ".join(f"{what} x{n}" for what, n in counts.items()) or "no tile"


def rank_device(device_kind: str) -> torch.device:
    if device_kind == "cuda":
        torch.cuda.set_device(0)  # every rank of these worlds shares the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")
