"""The cuDNN path end to end on a CPU world of 4 ranks: burst and ring, every layout, the masks cuDNN's
plan changes (causal; a causal window and documents as its triangles; a two-sided window handed to
aten's FlashAttention-2), against float64 attention on the whole sequence.

Each rank puts tests/cudnn_stand_in.py in place of torch's two cuDNN ops and flash_stand_in.AtenOps in
place of aten's flash ops (what cudnn hands band and varlen tiles to), makes bf16 dispatch to
kernels/cudnn.py as auto does on sm90+, and lowers cudnn.TRIANGLE_ROWS to this test's sizes, so that
windows and documents run as cuDNN's causal tiles and reversed ones across ranks. On an H200 cudnn ran
at 1 and 2 ranks (benchmarks/gpu.md); 4 ranks and the triangles have not run on a GPU.
"""

from __future__ import annotations

import burst
import torch

from cases import full_inputs, reference_grads, reference_mask, sharded_errors
from test_gpu_paths import FLASH_BOUND, dispatch_bf16_to
from world import results_by_world

SEQ = 256  # 64 tokens a rank: the window's 16 divides the shards; the documents cut them
DOCS = (0, 40, 56, 168, 256)
MASKS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(16, 0)),
    "documents": dict(causal=True, cu_seqlens=DOCS),
    "two-sided window": dict(window=(24, 9)),
}


def _use_cudnn_stand_in():
    """In this rank: cuDNN's and aten's flash ops are the stand-ins, and bf16 dispatches to cudnn."""
    from burst.kernels import aten_flash, cudnn

    import cudnn_stand_in
    import flash_stand_in

    ops = flash_stand_in.AtenOps(False)
    aten_flash._forward_op, aten_flash._backward_op = ops.forward, ops.backward
    aten_flash.varlen_lse_padded = lambda: False
    cudnn._forward_op, cudnn._backward_op = cudnn_stand_in.forward, cudnn_stand_in.backward
    cudnn.TRIANGLE_ROWS = 8
    dispatch_bf16_to(cudnn)  # no softcap among these masks
    return cudnn_stand_in.CALLS, flash_stand_in.CALLS


def _cases(rank, world):
    cudnn_calls, flash_calls = _use_cudnn_stand_in()
    full = full_inputs(3, 1, SEQ, 4, 2, 16, torch.bfloat16)
    results = []
    for mask_name, mask in MASKS.items():
        ref = reference_grads(*full, causal=False, mask=reference_mask(SEQ, **mask))
        for layout in ("contiguous", "zigzag", "striped"):
            for strategy in ("burst", "ring"):
                cudnn_calls.clear()
                flash_calls.clear()
                with burst.CommStats() as stats:
                    errs = sharded_errors(full, ref, torch.bfloat16, layout=layout, strategy=strategy, **mask)
                errs.update(dense_masks=stats.dense_masks(), cudnn_calls=len(cudnn_calls), flash_calls=len(flash_calls))
                results.append(((mask_name, layout, strategy), errs))
    return results


_results = results_by_world(_cases)


def test_every_layout_and_mask_is_exact_through_cudnn():
    for rank, cases in enumerate(_results(4)):
        assert len(cases) == len(MASKS) * 3 * 2
        for key, errs in cases:
            for name, limit in FLASH_BOUND.items():
                assert errs[name] <= limit, (rank, key, name, errs[name])
            assert errs["dense_masks"] == 0, (rank, key)


def test_windows_and_documents_run_on_cudnns_triangles():
    """Every contiguous and zigzag case reaches cuDNN (striped runs' bands are few rows of a stride-4 run:
    under TRIANGLE_ROWS, they stay FlashAttention-2's band and varlen calls); a causal window whose width divides
    the tiles runs on cuDNN alone on contiguous shards (triangles, reversed ones across the ranks'
    edges); a two-sided window is handed to FlashAttention-2's band arguments."""
    for rank, cases in enumerate(_results(4)):
        by_key = dict(cases)
        without = {key for key, errs in by_key.items() if not errs["cudnn_calls"]}
        assert all(layout == "striped" for _, layout, _ in without), (rank, without)
        assert by_key[("window", "contiguous", "ring")]["flash_calls"] == 0, rank
        assert all(by_key[("two-sided window", layout, "ring")]["flash_calls"] for layout in ("contiguous", "zigzag"))


def test_the_cudnn_ops_take_the_arguments_the_adapter_passes_by_position():
    """available() keeps FlashAttention-2 on a torch whose cuDNN ops' schemas differ from these (the adapter
    passes them by position): this torch's match, so an H100/H200 with it runs cuDNN."""
    from burst.kernels import cudnn

    if cudnn._forward_op is None:
        return  # a torch without the ops: available() says False before any schema
    assert cudnn._arguments(cudnn._forward_op) == cudnn._FORWARD_ARGUMENTS
    assert cudnn._arguments(cudnn._backward_op) == cudnn._BACKWARD_ARGUMENTS
