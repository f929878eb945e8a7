"""What a ring step adds to its kernel call: the float32 merge of a block's output and the backward's
rebuilt out, before and after the 2026-11-28 change (benchmarks/merge.md).

    .venv/bin/python benchmarks/merge_bench.py [--rows 8192] [--heads 32] [--dim 128] [--device cpu]
                                               [--dtype bfloat16|float32]

"before" is the code the change replaced, kept here as the baseline: the block's output converted to
float32 and scaled in place, then added (merge), and dout converted to float32, scaled, converted back
(rebuild). "after" is burst's own (burst.merge.merge_partial, kernels.out_from_delta). Both are checked
to agree before they are timed. Bytes per element are counted from the passes each makes over the
(rows, heads, dim) tensors, for blocks in --dtype (bf16: 2 bytes, as a GPU kernel returns them; float32:
4, as burst's CPU kernel does for float32 input) into float32 accumulators.
"""

from __future__ import annotations

import argparse

import torch

from burst.bench.harness import _time_passes
from burst.kernels.accumulators import out_from_delta
from burst.merge import merge_partial, merged_lse_and_weights


def merge_before(out_acc, lse_acc, out_blk, lse_blk):
    lse_new, w_acc, w_blk = merged_lse_and_weights(lse_acc, lse_blk)
    out_acc.mul_(w_acc).add_(out_blk.to(out_acc.dtype).mul_(w_blk))
    lse_acc.copy_(lse_new)


def rebuild_before(dout, delta):
    norm2 = torch.linalg.vector_norm(dout, dim=-1, dtype=torch.float32).square_()
    coef = torch.where(norm2 > 0, delta.transpose(1, 2) / norm2.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return (dout.float() * coef.unsqueeze(-1)).to(dout.dtype)


def counted_bytes(op: str, code: str, size: int) -> int:
    """Bytes per element the op moves, blocks of `size` bytes a number into float32 accumulators."""
    converted = 0 if size == 4 else size + 4  # a float32 copy of the block (none when it is float32)
    if op == "merge":  # scale acc; (convert the block;) scale it in place; add  /  scale acc; addcmul
        return 8 + converted + 8 + 12 if code == "before" else 8 + 8 + size
    # norm; (convert dout;) scale; (round back)  /  norm; one multiply into dout's dtype
    return size + converted + 8 + converted if code == "before" else 3 * size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = p.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(0)
    shape = (1, a.rows, a.heads, a.dim)
    out_acc = torch.randn(shape, device=device)
    lse_acc = torch.randn(1, a.heads, a.rows, device=device)
    dtype = getattr(torch, a.dtype)
    out_blk = torch.randn(shape, device=device).to(dtype)
    lse_blk = torch.randn(1, a.heads, a.rows, device=device)
    dout = torch.randn(shape, device=device).to(dtype)
    delta = torch.randn(1, a.heads, a.rows, device=device)

    merged = {}
    for name, fn in (("before", merge_before), ("after", merge_partial)):
        acc, lse = out_acc.clone(), lse_acc.clone()
        fn(acc, lse, out_blk.clone(), lse_blk)  # before scales a float32 block in place
        merged[name] = acc
    torch.testing.assert_close(merged["after"], merged["before"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_from_delta(dout, delta), rebuild_before(dout, delta), rtol=0, atol=0)

    elements = out_acc.numel()
    acc, lse, blk_before = out_acc.clone(), lse_acc.clone(), out_blk.clone()
    runs = {
        ("merge", "before"): lambda: merge_before(acc, lse.copy_(lse_acc), blk_before, lse_blk),
        ("merge", "after"): lambda: merge_partial(acc, lse.copy_(lse_acc), out_blk, lse_blk),
        ("rebuild", "before"): lambda: rebuild_before(dout, delta),
        ("rebuild", "after"): lambda: out_from_delta(dout, delta),
    }
    print(f"device {device}, {torch.get_num_threads()} threads, block {shape} {a.dtype} into float32 accumulators")
    print("| op | code | ms | bytes / element (counted) | GB/s at the counted bytes |")
    print("|---|---|---|---|---|")
    for (op, code), fn in runs.items():
        seconds, _, _ = _time_passes(a.repeats, device, fn, lambda _: None, lambda: None)  # best after a warm-up
        per = counted_bytes(op, code, out_blk.element_size())
        print(f"| {op} | {code} | {1e3 * seconds:.1f} | {per} | {per * elements / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
