"""The GPU path end to end on a CPU world: every strategy, layout and mask through the flash_attn adapter.

Each rank puts the flash_attn stand-in (tests/flash_stand_in.py: flash_attn's argument rules, float64
arithmetic) in place of the package and makes bf16 dispatch to kernels/cuda_flash_attn.py, as it does
on a GPU. Every case is compared with float64 attention on the whole sequence (the bounds of what the
stand-ins compute: FLASH_BOUND), each refusal is named (may_refuse), and every case must
reach the kernel with its masks as arguments: no call builds a dense mask (CommStats.dense_masks) for
causal, sliding-window or document masks, whatever the layout puts side by side; block-sparse tiles go
whole, as rules, to FlexAttention (its stand-in: tests/flex_stand_in.py), and so do DeepSeek-V4's
compressed entries (tests/test_compressed.py's cases). One world of 4 ranks.
"""

from __future__ import annotations

import burst
import torch
from burst.layout import DocumentLayout
from burst.masks import BlockSparseMask

from cases import TOL, full_inputs, reference_grads, reference_mask, sharded_errors
from world import results_by_world

WORLD = 4
SEQ = 256  # 64 tokens per rank: windows and documents cut shards and tiles off their diagonals
DOCS = (0, 40, 56, 168, 256)  # uneven, one longer than a shard
STRATEGIES = ("burst", "ring", "distflash", "usp", "cqs")
LAYOUTS = ("contiguous", "zigzag", "striped")
MASKS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(40, 0)),
    "two-sided window": dict(window=(24, 9)),
    "documents": dict(causal=True, cu_seqlens=DOCS),
    "documents + window": dict(causal=True, window=(20, 0), cu_seqlens=DOCS),
    "block-sparse": dict(
        causal=True,
        block_sparse=BlockSparseMask(
            32, torch.tensor([[i >= j and (i - j) % 3 != 1 for j in range(SEQ // 32)] for i in range(SEQ // 32)])
        ),
    ),
    "chunks": dict(causal=True, chunk_size=48),  # Llama 4's chunked attention: documents of equal length
    "softcap": dict(causal=True, softcap=1.0),  # flash_attn's own softcap argument
}


def _reference(full, mask):
    """float64 results on the full sequence for one of MASKS (chunks and the cap built here)."""
    plain = {key: value for key, value in mask.items() if key not in ("chunk_size", "softcap")}
    allowed = reference_mask(SEQ, **plain)
    if "chunk_size" in mask:
        chunk = torch.arange(SEQ) // mask["chunk_size"]
        allowed &= chunk[:, None] == chunk[None, :]
    return reference_grads(*full, causal=False, mask=allowed, softcap=mask.get("softcap", 0.0))


def _use_flash_stand_in():
    """In this rank: flash_attn and FlexAttention are the stand-ins (torch has no FlexAttention backward
    on the CPU), and bf16 dispatches to the flash_attn adapter."""
    from burst.kernels import cuda_flash_attn
    from torch.nn.attention import flex_attention

    import flash_stand_in
    import flex_stand_in

    flash_stand_in.install()
    flex_stand_in.CALLS = flash_stand_in.CALLS  # one log of kernel calls
    flex_attention.flex_attention = flex_stand_in.flex_attention
    flex_attention.create_block_mask = flex_stand_in.create_block_mask
    cuda_flash_attn.available.cache_clear()
    dispatch_bf16_to(cuda_flash_attn)
    return flash_stand_in.CALLS


def dispatch_bf16_to(kernel) -> None:
    """In this rank, burst's validation selects `kernel` for bf16 (bound to the call's softcap), as auto
    does on a GPU, and its own choice for every other dtype."""
    from burst import validation
    from burst.kernels import Softcapped

    select = validation.select_kernel

    def for_bf16(device, dtype, softcap=0.0, head_dim=None, v_head_dim=None):
        if dtype != torch.bfloat16:
            return select(device, dtype, softcap, head_dim, v_head_dim)
        return Softcapped(kernel, softcap) if softcap else kernel

    validation.select_kernel = for_bf16


def runs(mask_name, layout, strategy) -> bool:
    """burst, ring and distflash (refusing) meet every mask in every layout; usp and cqs, whose kernel calls
    are the ring's after their own exchange, the documents in every layout (usp's reach the varlen interface
    where burst's and ring's do not) and each other mask in one layout, the three taken in turn."""
    if strategy not in ("usp", "cqs") or mask_name.startswith("documents"):
        return True
    return LAYOUTS[(list(MASKS).index(mask_name) + STRATEGIES.index(strategy)) % len(LAYOUTS)] == layout


def _cases(rank, world):
    calls = _use_flash_stand_in()
    full = full_inputs(3, 1, SEQ, 4, 2, 16, torch.bfloat16)  # bf16 values: the reference sees what the kernels see
    results = []
    for mask_name, mask in MASKS.items():
        ref = _reference(full, mask)
        for layout in LAYOUTS:
            for strategy in STRATEGIES:
                if not runs(mask_name, layout, strategy):
                    continue
                calls.clear()
                try:
                    with burst.CommStats() as stats:
                        errs = sharded_errors(full, ref, torch.bfloat16, layout=layout, strategy=strategy, **mask)
                except ValueError as err:  # refused: only where may_refuse names it (test below)
                    results.append(((mask_name, layout, strategy), str(err).split("\n")[0]))
                    continue
                errs["dense_masks"] = stats.dense_masks()
                errs["flash_calls"] = len(calls)
                errs["varlen_calls"] = sum(name.startswith("varlen") for name, *_ in calls)
                errs["flex_calls"] = sum(name == "flex_attention" for name, *_ in calls)
                results.append(((mask_name, layout, strategy), errs))
    # Per-document layouts: each document cut across the ranks on its own.
    ref = reference_grads(*full, causal=False, mask=reference_mask(SEQ, causal=True, cu_seqlens=DOCS))
    for split in ("contiguous", "zigzag"):
        calls.clear()
        with burst.CommStats() as stats:
            errs = sharded_errors(
                full, ref, torch.bfloat16, layout=DocumentLayout(DOCS, split), causal=True, strategy="burst"
            )
        errs.update(
            dense_masks=stats.dense_masks(),
            flash_calls=len(calls),
            flex_calls=sum(name == "flex_attention" for name, *_ in calls),
            varlen_calls=sum(name.startswith("varlen") for name, *_ in calls),
        )
        results.append((("doc layout", split, "burst"), errs))
    return results + _long_window_cases(calls) + _compressed_cases(calls, world)


def _long_window_cases(calls):
    """A two-sided window on 256-token shards: burst's served key chunks make band tiles with more
    queries than keys, whose windows FlashAttention-2 reads otherwise (Bands.flash_misreads; found on
    an H200: burst contiguous / zigzag two-sided window bf16 0.6-1.0 off at 2 and 4 ranks). burst only: ring
    serves no chunks (its tiles are whole shards), and its two-sided windows run in the cases above."""
    n, window = 1024, (128, 64)
    full = full_inputs(5, 1, n, 2, 1, 16, torch.bfloat16)
    ref = reference_grads(*full, causal=False, mask=reference_mask(n, window=window))
    results = []
    for layout in ("contiguous", "zigzag"):
        for strategy in ("burst",):
            calls.clear()
            with burst.CommStats() as stats:
                errs = sharded_errors(full, ref, torch.bfloat16, layout=layout, strategy=strategy, window=window)
            errs.update(
                dense_masks=stats.dense_masks(),
                flash_calls=len(calls),
                flex_calls=sum(name == "flex_attention" for name, *_ in calls),
                varlen_calls=sum(name.startswith("varlen") for name, *_ in calls),
            )
            results.append((("long window", layout, strategy), errs))
    return results


def _compressed_cases(calls, world):
    """DeepSeek-V4's compressed entries (burst.CompressedKV, a key run of stride 4) with a window and
    sinks, as tests/test_compressed.py builds them, through the flash_attn adapter: HCA-like (every
    ended entry: their causal tiles) and CSA-like (an index selection)."""
    import test_compressed as tc

    n = 16 * world  # 16 tokens a rank (test_compressed runs 8): bf16's rounding of these sums within its bound
    full = full_inputs(41, tc.B, n, tc.H, tc.HK, tc.D, torch.float64)
    ck, cv, sinks = tc.entries_and_sinks(n // tc.RATE, 7)
    results = []
    for kind, indices in (("hca", None), ("csa", tc.chosen_entries(n, n // tc.RATE, world))):
        ref = tc.reference(full, ck, cv, sinks, tc.allowed_pairs(n, n // tc.RATE, indices))
        for layout in LAYOUTS:
            for strategy in ("burst", "ring"):
                calls.clear()
                with burst.CommStats() as stats:
                    errs = tc._errors(full, ref, ck, cv, sinks, indices, torch.bfloat16, layout, strategy)
                errs.update(
                    dense_masks=stats.dense_masks(),
                    flash_calls=len(calls),
                    flex_calls=sum(name == "flex_attention" for name, *_ in calls),
                    varlen_calls=0,
                    dq=errs["dq"],
                )
                results.append(((f"compressed {kind}", layout, strategy), errs))
    return results


_all_results = results_by_world(_cases)


def _results(world):
    """Per rank, the cases that ran: (key, errors)."""
    return [[(key, errs) for key, errs in cases if not isinstance(errs, str)] for cases in _all_results(world)]


DISTFLASH_REFUSAL = (
    "strategy='distflash' supports layout='contiguous' with causal=True "
    "and no window, cu_seqlens, chunk_size or block_sparse"
)


def may_refuse(mask_name, layout, strategy) -> str | None:
    """The refusal's message where a strategy may refuse a case; None where it must run it: burst, ring,
    usp and cqs take every mask and layout; distflash only causal attention (softcap too) on contiguous shards."""
    if strategy == "distflash" and not (layout == "contiguous" and mask_name in ("causal", "softcap")):
        return DISTFLASH_REFUSAL
    return None


# What the stand-ins compute (tests/flash_stand_in.py, tests/flex_stand_in.py), on bf16 inputs the float64
# reference sees exactly: flash_attn's in float64, out rounded to bf16 once per block, lse in float32, so out
# and the gradients are off by bf16's rounding of a few merged blocks (measured <= 7.5e-3) and lse by
# float32's (measured ~1e-6); FlexAttention's (partial block-sparse tiles, DeepSeek-V4's entries) in bf16
# itself, so its scores' rounding reaches lse (measured ~2e-2): bf16's bound, reference.BOUNDS.
FLASH_BOUND = {"out": 1e-2, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "lse": TOL[torch.float32]}


def bound(key, errs) -> dict:
    """FLASH_BOUND, or bf16's where FlexAttention ran or the inputs are test_compressed's float64 ones
    (rounded to bf16 on the way in: the reference does not see them as the kernels do)."""
    if errs["flex_calls"] or key[0].startswith("compressed"):
        return {n: TOL[torch.bfloat16] for n in FLASH_BOUND}
    return FLASH_BOUND


def test_every_strategy_layout_and_mask_is_exact_through_flash_attn_arguments():
    failures = []
    for rank, cases in enumerate(_all_results(WORLD)):
        seen = {key for key, _ in cases}
        missing = {(m, layout, s) for m in MASKS for layout in LAYOUTS for s in STRATEGIES if runs(m, layout, s)} - seen
        assert {s for m, _, s in seen if m in MASKS} == set(STRATEGIES), rank
        for strategy in ("usp", "cqs"):  # every mask, and every layout, through each
            assert {m for m, _, s in seen if s == strategy} == set(MASKS), (rank, strategy)
            assert {layout for m, layout, s in seen if s == strategy and m in MASKS} == set(LAYOUTS), (rank, strategy)
        assert not missing, (rank, sorted(missing))
        for key, errs in cases:
            if isinstance(errs, str):  # refused: only where allowed, and with that refusal's message
                refusal = may_refuse(*key)
                if refusal is None or not errs.startswith(refusal):
                    failures.append(f"rank {rank} {key} refused: {errs!r} (allowed: {refusal!r})")
                continue
            limits = bound(key, errs)
            worst = {n: errs[n] for n in limits if not errs[n] <= limits[n]}
            if errs["nan"] or worst:
                failures.append(f"rank {rank} {key}: {worst or 'nan'}")
    assert not failures, "\n".join(failures)


def test_burst_and_ring_run_every_case():
    ran = {key for key, _ in _results(WORLD)[0]}
    for mask_name in MASKS:
        for layout in LAYOUTS:
            assert {(mask_name, layout, "burst"), (mask_name, layout, "ring")} <= ran, (mask_name, layout)


def test_no_dense_mask_is_built_for_any_mask():
    for rank, cases in enumerate(_results(WORLD)):
        for key, errs in cases:
            assert errs["dense_masks"] == 0, (rank, key, errs["dense_masks"])
            assert errs["flash_calls"] > 0, (rank, key)  # the adapter ran (not a silent fallback)


def test_block_sparse_tiles_reach_flex_attention():
    """Partial block-sparse tiles go whole to FlexAttention (under zigzag the 32-token chunks match the
    blocks: no tile is partial); no other mask needs it."""
    for cases in _results(WORLD):
        for (mask, layout, strategy), errs in cases:
            if mask.startswith("compressed") or mask == "long window":  # tests of their own below
                continue
            wanted = mask == "block-sparse" and layout != "zigzag"
            assert (errs["flex_calls"] > 0) == wanted, (mask, layout, strategy, errs["flex_calls"])


def test_documents_reach_the_varlen_interface():
    """A shard pair across documents goes to flash_attn as one varlen call, not one call per piece."""
    varlen = {key: errs["varlen_calls"] for cases in _results(WORLD) for key, errs in cases}
    for mask_name in ("documents", "documents + window"):
        for layout in LAYOUTS:
            assert any(varlen[(mask_name, layout, s)] for s in STRATEGIES if (mask_name, layout, s) in varlen), (
                mask_name,
                layout,
            )


def test_bands_flash_attn_would_misread_still_reach_flash():
    """The long-window cases ran exact (the first test; with each band handed to flash whole, as
    FlashAttention-2 reads its windows, burst contiguous is 0.2-0.6 off) and through flash (row pieces,
    Bands.flash_parts), not a fallback: no FlexAttention call, no dense mask."""
    for cases in _results(WORLD):
        for (mask, layout, strategy), errs in cases:
            if mask == "long window":
                assert errs["flash_calls"] > 0 and errs["flex_calls"] == 0 == errs["dense_masks"], (
                    layout,
                    strategy,
                    errs,
                )


def test_compressed_entries_through_flash_attn_arguments():
    """DeepSeek-V4's entries (a key run of stride 4 under a causal mask, CSA's choice as an index
    selection) on the GPU path: exact in bf16 with the entries' and sinks' gradients, their partial
    tiles whole to FlexAttention (per batch row for a selection), no dense mask built."""
    ran = 0
    for rank, cases in enumerate(_results(WORLD)):
        for key, errs in cases:
            if not key[0].startswith("compressed"):
                continue
            ran += 1
            measured = {n: errs[n] for n in ("out", "lse", "dq", "dk", "dv", "dck", "dcv", "dsinks")}
            assert not errs["nan"] and all(e <= TOL[torch.bfloat16] for e in measured.values()), (rank, key, measured)
            assert errs["dense_masks"] == 0 and errs["flash_calls"] > 0, (rank, key, errs)
            if key[1] != "striped":
                assert errs["flex_calls"] > 0, (rank, key, errs)
    assert ran == WORLD * 2 * len(LAYOUTS) * 2
