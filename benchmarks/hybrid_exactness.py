"""Every hybrid family burst splits (bt.FAMILIES), one training step at 2, 3 and 4 ranks.

    python benchmarks/hybrid_exactness.py [--worlds 2,3,4] [--out benchmarks/hybrid_exactness.md]

The zoo's tiny config of each family (hf_zoo.tiny_config), batch 2 x 64 tokens, split contiguous and
zigzag over local gloo processes, against the same model in one process with eager attention
(hf_steps.train_step_errors): logits, loss and every parameter gradient. The suite runs all families
at 2 ranks and one family per mixer at 4 (tests/test_hf_hybrid.py); this table is every family at
every world size.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from burst.launch import spawn_world

LAYOUTS = ("contiguous", "zigzag")


def world_rows(rank, world):
    import warnings

    import transformers

    import burst.integrations.transformers as bt
    from burst.bench import hf_steps, hf_zoo

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    shipped = [f for f in sorted(bt.FAMILIES) if f in hf_zoo.families()]
    return {
        (family, layout): hf_steps.train_step_errors(
            family, bt.register(f"exact_{layout}", layout=layout), layout, seq_len=64 if world < 3 else 96
        )
        for family in shipped
        for layout in LAYOUTS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,3,4")
    parser.add_argument("--out", default="benchmarks/hybrid_exactness.md")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    start = time.time()
    by_world = {w: spawn_world(world_rows, nproc=w, threads=1, timeout=3600)[0] for w in worlds}
    write(args.out, by_world, time.time() - start, args)


def write(path, by_world, seconds, args) -> None:
    import transformers

    worlds = list(by_world)
    keys = list(next(iter(by_world.values())))
    lines = [
        "# Hybrid families: one training step split across ranks vs one process",
        "",
        f"Made by `python benchmarks/hybrid_exactness.py --worlds {args.worlds}` with transformers "
        f"{transformers.__version__}, torch {torch.__version__}, {platform.machine()} CPU, in {seconds:.0f} s.",
        "",
        "Each cell: max abs difference of the logits / of the loss / largest parameter gradient's max abs "
        "difference relative to that gradient's max, or to 1/100 of the largest gradient where that is more "
        "(hf_steps.train_step_errors; fp32, batch 2, 64 tokens at 2 ranks, 96 at 3-4). The suite's bounds "
        "(tests/test_hf_hybrid.py): 2e-5 / 2e-5 / 1e-4.",
        "",
        "| family | layout | " + " | ".join(f"{w} ranks" for w in worlds) + " |",
        "|---|---|" + "---|" * len(worlds),
    ]
    worst = 0.0
    for family, layout in keys:
        cells = []
        for w in worlds:
            e = by_world[w][(family, layout)]
            worst = max(worst, e["logits"], e["loss"], e["gradients"] / 5)
            cells.append(f"{e['logits']:.1e} / {e['loss']:.1e} / {e['gradients']:.1e}")
        lines.append(f"| {family} | {layout} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{len(keys) // len(LAYOUTS)} families; every cell within the suite's bounds: "
        f"{'yes' if worst < 2e-5 else 'NO'}.",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
