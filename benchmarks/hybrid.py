"""Hybrid models at long sequences: one training step split over G ranks against one process.

    python benchmarks/hybrid.py [--families qwen3_next,bamba] [--seq-lens 16384,32768] [--worlds 2,4]
                                [--out benchmarks/hybrid.md]

Each family's small config (below: a few layers of its recurrent mixer and one attention layer),
random weights, one forward + backward on a batch of one sequence: one process with 2 threads (eager
attention is replaced by SDPA there; transformers' torch scans), then G local processes (gloo) of
max(1, 2 // G) threads with burst's backend, zigzag, the mixers hooked (shard_mixers). Reports the
step time, the loss's and the embedding gradient's (max abs) difference from one process, and the
bytes each rank sent for the mixers' state exchange (the mixers' phases) next to attention's.
"""

from __future__ import annotations

import argparse
import copy
import platform
import time

import torch

from burst.launch import spawn_world

STATE_PHASES = ("gated_delta_rule_state", "mamba2_state", "mamba_state", "conv_halo")


def config(family: str):
    """A small config of `family`: hidden 256, its mixer layers and one attention layer."""
    from burst.bench.hf_zoo import tiny_config

    base = tiny_config(family)
    text = base.get_text_config(decoder=True)
    for key, value in {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "head_dim": 32,
        "num_key_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "mamba_d_state": 64,
        "mamba_chunk_size": 256,
        "max_position_embeddings": 1 << 17,
    }.items():
        if hasattr(text, key):
            setattr(text, key, value)
    return base


def _step(model, batch):
    start = time.perf_counter()
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out, time.perf_counter() - start


def one_process(rank, world, family, seq):
    import warnings

    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config(family)), attn_implementation="sdpa")
    ids = torch.randint(3, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    out, seconds = _step(model, {"input_ids": ids, "labels": ids})
    return {"loss": out.loss.item(), "seconds": seconds, "embedding_grad": model.get_input_embeddings().weight.grad}


def sharded(rank, world, family, seq):
    import warnings

    import transformers
    from transformers import AutoModelForCausalLM

    import burst
    import burst.integrations.transformers as bt

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    name = bt.register("burst", layout="zigzag")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config(family)), attn_implementation=name)
    ids = torch.randint(3, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, layout="zigzag", model=model)
    with burst.CommStats() as stats:
        out, seconds = _step(model, batch)
    state = sum(stats.sent(p) for p in STATE_PHASES)
    attention = stats.sent("forward") + stats.sent("backward")
    bt.reduce_gradients(model)
    return {
        "loss": bt.reduce_loss(out.loss).item(),
        "seconds": seconds,
        "state_bytes": state,
        "attention_bytes": attention,
        "embedding_grad": model.get_input_embeddings().weight.grad,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="qwen3_next,bamba")
    parser.add_argument("--seq-lens", default="16384,32768")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--out", default="benchmarks/hybrid.md")
    args = parser.parse_args()
    rows = []
    for family in args.families.split(","):
        for seq in (int(s) for s in args.seq_lens.split(",")):
            alone = spawn_world(one_process, family, seq, nproc=1, threads=2, timeout=3600)[0]
            for world in (int(w) for w in args.worlds.split(",")):
                got = spawn_world(sharded, family, seq, nproc=world, threads=max(1, 2 // world), timeout=3600)
                slowest = max(r["seconds"] for r in got)
                grad = (got[0]["embedding_grad"] - alone["embedding_grad"]).abs().max().item()
                rows.append(
                    (
                        family,
                        seq,
                        world,
                        alone["seconds"],
                        slowest,
                        abs(got[0]["loss"] - alone["loss"]),
                        grad,
                        max(r["state_bytes"] for r in got),
                        max(r["attention_bytes"] for r in got),
                    )
                )
                print(rows[-1], flush=True)
                write(args.out, rows, args)
    write(args.out, rows, args)


def write(path, rows, args) -> None:
    import transformers

    lines = [
        "# Hybrid models split across ranks (gated delta net, Mamba2 scans, short convolutions)",
        "",
        f"Made by `python benchmarks/hybrid.py --families {args.families} --seq-lens {args.seq_lens} --worlds "
        f"{args.worlds}` with transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{platform.machine()} CPU with 2 cores.",
        "",
        "One training step (forward + backward, batch 1) of each family's small config (hidden 256, its mixer "
        "layers and one attention layer; `benchmarks/hybrid.py: config`), random weights. One process: 2 threads, "
        "SDPA attention, transformers' torch scans. G ranks: local gloo processes with 2 // G threads each (4 "
        "ranks share 2 cores: their time is oversubscribed, shown for completeness), burst's backend, zigzag, the "
        "mixers split by `shard_mixers`. State bytes: what one rank sent for the recurrent layers' state "
        "exchange and the convolution halos (one all-gather each per layer, forward and backward); attention "
        "bytes: the ring's.",
        "",
        "| family | tokens | ranks | one process (s) | split (s, slowest rank) | speed-up | loss difference | "
        "embedding gradient difference | state bytes / rank | attention bytes / rank |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family, seq, world, alone, split, diff, grad, state, attention in rows:
        lines.append(
            f"| {family} | {seq} | {world} | {alone:.2f} | {split:.2f} | {alone / split:.2f} | {diff:.1e} | "
            f"{grad:.1e} | {state / 1024:.0f} KiB | {attention / 2**20:.1f} MiB |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
