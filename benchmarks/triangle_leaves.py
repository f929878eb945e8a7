"""What the CPU kernel's causal path costs per attended pair, by triangle size and by the leaf size that
masks.TileSizes halves triangles down to (issue 29 item 1; sets kernels/cpu_flash.py LEAF_ROWS).

One process, 1 thread, fp32, 8 heads, dim 64; forward + backward of each planned tile, best of 3 after a
warm-up; per attended pair, relative to a full 1024 x 1024 call's per pair.

    .venv/bin/python benchmarks/triangle_leaves.py [--rows 256,512,1024,2048,4096] [--leaves 128,64,32]
"""

from __future__ import annotations

import argparse
import time

import torch

from burst.kernels import cpu_flash
from burst.layout import Segment
from burst.masks import MaskSpec, TileSizes, plan_tiles

HEADS, DIM, SPAN = 8, 64, 4096  # each size is timed over SPAN rows of triangles


def _seconds(tiles, q, k, v, do) -> float:
    """Best of 3 (after a warm-up) of forward + backward over the tiles."""
    out = torch.zeros_like(q)
    lse = torch.zeros(1, HEADS, q.shape[1])
    best = float("inf")
    for rep in range(4):
        start = time.perf_counter()
        for t in tiles:
            qr, kr = t.q.rows, t.k.rows
            o, l = cpu_flash.forward(q[:, qr], k[:, kr], v[:, kr], DIM**-0.5, t.causal, t.mask)
            out[:, qr], lse[:, :, qr] = o, l  # stand-ins: the backward's cost does not depend on them
            cpu_flash.backward(
                do[:, qr], q[:, qr], k[:, kr], v[:, kr], out[:, qr], lse[:, :, qr], DIM**-0.5, t.causal, t.mask
            )
        if rep:
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="256,512,1024,2048,4096")
    parser.add_argument("--leaves", default="128,64,32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, SPAN, HEADS, DIM) for _ in range(4))
    whole = Segment(0, SPAN, 0)
    full = plan_tiles([whole], [Segment(0, 1024, 0)], MaskSpec(), sizes=TileSizes(1024))
    per_full_pair = _seconds(full, q, k, v, do) / (SPAN * 1024)
    leaves = [int(x) for x in args.leaves.split(",")]
    print("| triangle rows | causal path, whole | " + " | ".join(f"halved to {n}-row leaves" for n in leaves) + " |")
    print("|---|---|" + "---|" * len(leaves))
    for n in (int(x) for x in args.rows.split(",")):
        segs = [Segment(i, n, i) for i in range(0, SPAN, n)]  # SPAN // n triangles on the diagonal
        cells = []
        for leaf, split in [(n, False)] + [(leaf, True) for leaf in leaves]:
            tiles = [
                t for s in segs for t in plan_tiles([s], [s], MaskSpec(causal=True), sizes=TileSizes(n, leaf, split))
            ]
            pairs = sum(t.pairs for t in tiles)
            cells.append(f"{_seconds(tiles, q, k, v, do) / pairs / per_full_pair:.2f}")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
