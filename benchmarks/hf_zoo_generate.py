"""The transformers zoo's generate() on burst: every causal-LM family, greedy on a ShardedCache against
its own eager generate() in one process (burst/bench/hf_zoo_generate.py).

    python benchmarks/hf_zoo_generate.py [--families llama,gpt_oss] [--out benchmarks/hf_zoo_generate.md]

Runs local worlds of 2 CPU processes (gloo; a new one for the families left when one ends early) and
writes the table as Markdown. --logs keeps each rank's log (every crash's traceback) in a folder.
"""

from __future__ import annotations

import argparse
import collections
import platform
import shlex
import sys
import time

import torch

from burst.bench.hf_zoo_generate import FAMILY_SECONDS, LAYOUT, NEW, PROMPT, TOLERANCE, run_zoo, table

OUTCOMES = ("exact", "refused", "skip", "silent", "crash")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=None, help="comma-separated model types (default: all)")
    parser.add_argument("--out", default="benchmarks/hf_zoo_generate.md")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--family-seconds", type=float, default=FAMILY_SECONDS, help="a family's time limit")
    parser.add_argument("--logs", default=None, help="a folder to keep the ranks' logs in")
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens")
    parser.add_argument("--new", type=int, default=NEW, help="new tokens")
    args = parser.parse_args()
    families = args.families.split(",") if args.families else None
    start = time.time()
    lengths = (args.prompt, args.new)
    rows = run_zoo(families, nproc=args.nproc, family_seconds=args.family_seconds, keep=args.logs, lengths=lengths)
    seconds = time.time() - start
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/hf_zoo_generate.py", *sys.argv[1:]])
    with open(args.out, "w") as f:
        f.write(report(rows, seconds, command, args.nproc, lengths))
    print(f"wrote {args.out} ({len(rows)} families, {seconds:.0f} s)")


def report(rows: dict, seconds: float, command: str, nproc: int, lengths=(PROMPT, NEW)) -> str:
    import transformers

    counts = collections.Counter(o.outcome for o in rows.values())
    exact = sorted(f for f, o in rows.items() if o.outcome == "exact")
    return "\n".join(
        [
            "# transformers' causal-LM zoo: generate() on burst",
            "",
            f"Made by `{command}` with transformers {transformers.__version__}, torch {torch.__version__}, "
            f"{platform.machine()} CPU, in {seconds:.0f} s on {nproc} processes.",
            "",
            "Each family of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built tiny from its own config class as the "
            "forward zoo builds it (burst/bench/hf_zoo_configs.py: `tiny_config`), random weights. A prompt of "
            f"{lengths[0]} token ids, {lengths[1]} new tokens, greedy (`do_sample=False`, no eos: the length is "
            "fixed), `output_logits=True`: `model.generate(ids, **bt.sharded_cache(model))` on "
            f'`bt.register(..., layout="{LAYOUT}")` at {nproc} ranks against the same weights\' eager attention '
            "generating in one process on the family's own cache. exact: the same tokens on every rank and as "
            f"the reference, every step's logits bit-identical on every rank and within {TOLERANCE:g} of the "
            "reference's (max |x - ref| / max |ref|); refused: a clear error from burst (or transformers' own, "
            "when it cannot build the family on a custom attention implementation); skip: the family cannot be "
            "built tiny or its eager model does not generate from token ids alone (the reason is given); "
            "silent / crash: what must never happen (a silent row's control says whether the eager model's own "
            f"forward without a cache agrees with its generate(); a crash includes a rank past {FAMILY_SECONDS:g} "
            "s or ranks that disagree).",
            "",
            f"- {nproc} ranks {LAYOUT}: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES) + f" (of {len(rows)})",
            "",
            f"Exact ({len(exact)}): " + ", ".join(exact) + ".",
            "",
            table(rows),
            "",
        ]
    )


if __name__ == "__main__":
    main()
