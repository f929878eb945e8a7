"""Multi-head latent attention across ranks: the latent on the ring against the expanded heads.

    .venv/bin/python benchmarks/mla.py [--tokens 1024,2048] [--worlds 2,4,8] [--out benchmarks/mla.md]

A DeepSeek-V3 and a Kimi-K2 config at their published attention shapes (heads 128 / 64, qk_nope 128,
qk_rope 64, v 128, kv_lora_rank 512, q_lora_rank 1536) with one decoder layer, a narrow hidden size
(256), a dense MLP and a small vocabulary; random weights; one forward + backward of a batch of one
sequence through the README's door (bt.shard_batch(model=), reduce_gradients), zigzag, burst's
backend, on G local processes (gloo, one thread each). Two backends side by side: "latent" (the
default: each MLA layer hands burst its latent, burst/latent.py) and "expanded" (backward_side=
"queries", which keeps the layer's own expansion: what burst moved before, 128 expanded heads on the
query side of the backward). CommStats gives the bytes each rank sent, forward and backward.
The two runs' logits and loss are compared (they compute the same attention).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

SHAPES = {"DeepSeek-V3": 128, "Kimi-K2": 64}  # attention heads; the rest of the attention shapes are shared


def config(heads: int):
    from burst.bench.hf_zoo import tiny_config

    c = tiny_config("deepseek_v3")
    for key, value in {
        "hidden_size": 256,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "head_dim": 64,
        "num_hidden_layers": 1,
        "first_k_dense_replace": 1,
        "intermediate_size": 256,
        "max_position_embeddings": 1 << 16,
    }.items():
        setattr(c, key, value)
    return c


def measure(rank, world, tokens_list, timed):
    """{(shape, tokens, backend): (fwd bytes, bwd bytes, loss, seconds)} on this rank."""
    import copy

    import burst
    import burst.integrations.transformers as bt
    from burst.bench.hf_steps import sharded_step
    from transformers import AutoModelForCausalLM

    names = {
        "latent": bt.register("burst_mla_latent", strategy="burst", layout="zigzag"),
        "expanded": bt.register("burst_mla_expanded", strategy="burst", layout="zigzag", backward_side="queries"),
    }
    out = {}
    for shape, heads in SHAPES.items():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config(heads), attn_implementation="eager")
        for tokens in tokens_list:
            ids = torch.randint(3, 96, (1, tokens), generator=torch.Generator().manual_seed(1))
            for backend, name in names.items():
                model = copy.deepcopy(base)
                model.set_attn_implementation(name)
                with burst.CommStats() as stats:
                    logits, loss = sharded_step(model, ids, "zigzag")
                seconds = None
                if timed:
                    best = []
                    for _ in range(2):
                        model.zero_grad()
                        torch.distributed.barrier()
                        began = time.perf_counter()
                        sharded_step(model, ids, "zigzag")
                        torch.distributed.barrier()
                        best.append(time.perf_counter() - began)
                    seconds = min(best)
                out[(shape, tokens, backend)] = (
                    stats.sent("forward"),
                    stats.sent("backward"),
                    loss,
                    logits[0, -1, :8].tolist(),
                    seconds,
                    stats.choices(),
                )
    return out


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,2048")
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--time", action="store_true", help="time each step at 2 ranks (best of 2)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from burst.launch import spawn_world

    tokens_list = [int(t) for t in args.tokens.split(",")]
    lines = [
        "# MLA across ranks: the latent on the ring",
        "",
        f"Command: `.venv/bin/python benchmarks/mla.py --tokens {args.tokens} --worlds {args.worlds}"
        + (" --time" if args.time else "")
        + (f" --out {args.out}" if args.out else "")
        + "`  ",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}; float32; one "
        "decoder layer at the published attention shapes (qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512); "
        "zigzag; one forward + backward through bt.shard_batch(model=); MiB sent per rank (max over ranks) and "
        "summed over the ranks.",
        "",
        "| shape | G | tokens | latent fwd + bwd per rank | expanded fwd + bwd per rank | latent, all ranks | "
        "expanded, all ranks | expanded / latent | loss latent - expanded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    timing = []
    for world in (int(w) for w in args.worlds.split(",")):
        began = time.time()
        per_rank = spawn_world(measure, tokens_list, args.time and world == 2, nproc=world, threads=1, timeout=3000)
        print(f"G={world}: {time.time() - began:.0f} s", flush=True)
        for shape in SHAPES:
            for tokens in tokens_list:
                cells = {}
                for backend in ("latent", "expanded"):
                    got = [r[(shape, tokens, backend)] for r in per_rank]
                    assert backend != "latent" or got[0][5].get("keys=latent"), (shape, got[0][5])
                    cells[backend] = (
                        max(g[0] for g in got),
                        max(g[1] for g in got),
                        sum(g[0] + g[1] for g in got),
                        got[0][2],
                        got[0][4],
                    )
                lat, exp = cells["latent"], cells["expanded"]
                lines.append(
                    f"| {shape} | {world} | {tokens} | {_mib(lat[0])} + {_mib(lat[1])} | {_mib(exp[0])} + "
                    f"{_mib(exp[1])} | {_mib(lat[2])} | {_mib(exp[2])} | {exp[2] / lat[2]:.1f} | "
                    f"{lat[3] - exp[3]:.1e} |"
                )
                if lat[4] is not None:
                    timing.append(f"| {shape} | {tokens} | {lat[4]:.2f} | {exp[4]:.2f} | {lat[4] / exp[4]:.2f} |")
    if timing:
        lines += [
            "",
            "Time on this CPU, 2 ranks x 1 thread, one forward + backward of the model (best of 2), seconds:",
            "",
            "| shape | tokens | latent | expanded | latent / expanded |",
            "|---|---|---|---|---|",
            *timing,
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
