"""The transformers zoo on burst: every causal-LM family, exact or refused (burst/bench/hf_zoo.py).

    python benchmarks/hf_zoo.py [--families llama,gpt_oss] [--out benchmarks/hf_zoo.md]

Runs a local world of 2 CPU processes (gloo): each family at 1 rank and at 2 ranks (contiguous and
zigzag) against the same model's eager attention in one process, and writes the table as Markdown.
"""

from __future__ import annotations

import argparse
import collections
import platform
import time

import torch

from burst.bench.hf_zoo import GRADIENT_TOLERANCE, TOLERANCE, zoo_world
from burst.launch import spawn_world

OUTCOMES = ("exact", "refused", "skip", "silent", "crash")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=None, help="comma-separated model types (default: all)")
    parser.add_argument("--out", default="benchmarks/hf_zoo.md")
    args = parser.parse_args()
    families = args.families.split(",") if args.families else None
    start = time.time()
    rows = spawn_world(zoo_world, families, nproc=2, threads=1, timeout=1800)[0]
    seconds = time.time() - start
    with open(args.out, "w") as f:
        f.write(report(rows, seconds))
    print(f"wrote {args.out} ({len(rows)} families, {seconds:.0f} s)")


def report(rows: dict, seconds: float) -> str:
    import transformers

    from burst.bench.hf_zoo import table

    settings = list(next(iter(rows.values())))
    counts = []
    for setting in settings:
        c = collections.Counter(by[setting].outcome for by in rows.values())
        counts.append(f"- {setting}: " + ", ".join(f"{o} {c[o]}" for o in OUTCOMES) + f" (of {len(rows)})")
    exact_everywhere = sorted(f for f, by in rows.items() if all(o.outcome == "exact" for o in by.values()))
    return "\n".join(
        [
            "# transformers' causal-LM zoo on burst",
            "",
            "Made by `python benchmarks/hf_zoo.py` (tests/test_hf_zoo.py asserts the same outcomes' rules) with "
            f"transformers {transformers.__version__}, torch {torch.__version__}, {platform.machine()} CPU, "
            f"in {seconds:.0f} s on 2 processes.",
            "",
            "Each family of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built tiny from its own config class "
            "(burst/bench/hf_zoo_configs.py: `tiny_config`), 128 tokens, random weights; logits and loss of "
            '`bt.register("burst")` (1 rank, then 2 ranks with `bt.shard_batch` in the contiguous and the zigzag '
            "layout) against the same model's eager attention in one process (logits alone where the family's own "
            'loss needs more than token ids: "exact: logits only"). exact: within '
            f"{TOLERANCE:g} (max abs), and one backward's every parameter gradient within {GRADIENT_TOLERANCE:g} "
            "(relative, where the loss runs); refused: a clear error from burst (or transformers' own, when it "
            "cannot build the family with a custom attention implementation); skip: the family cannot be built "
            "tiny or does not run eagerly on token ids alone (the reason is given); silent / crash: what must never "
            "happen.",
            "",
            *counts,
            "",
            f"Exact in every setting ({len(exact_everywhere)}): " + ", ".join(exact_everywhere) + ".",
            "",
            table(rows),
            "",
        ]
    )


if __name__ == "__main__":
    main()
