"""DeepSeek sparse attention across ranks: what the indexer's keys (and DeepSeek-V4's compressed
entries) cost next to attention's own traffic.

    python benchmarks/dsa_bytes.py [--seq-lens 1024,2048] [--worlds 2,4] [--out benchmarks/dsa_bytes.md]
    python benchmarks/dsa_bytes.py --family deepseek_v4 --seq-lens 2048,4096 --out benchmarks/compressed_bytes.md

A DeepSeek-V3.2 config with its published attention shapes per head (MLA: qk_nope 128, qk_rope 64,
v 128; indexer: index_head_dim 128, 64 index heads at full size) but 16 attention heads, 2 layers, a
narrow hidden size and index_topk 256; random weights, one forward + backward of a batch of one
sequence split over G local processes (gloo), zigzag, burst's backend. CommStats gives the bytes one
rank sent per phase: "indexer" (the indexer's keys, gathered once per layer: burst/integrations/
transformers/layers/indexer.py), "forward" and "backward" (attention's K, V and its backward's
traffic). Also checked: the logits and the indexer's selections against one process.

A DeepSeek-V4 config with its published attention shapes (head_dim 512 with 64 rotary dims, one K=V
head, a 128-token sliding window and sinks; CSA entries of 4 tokens chosen by an indexer of
index_head_dim 128 with index_topk 512; HCA entries of 128 tokens) but 8 query heads, one CSA and one
HCA layer, a narrow hidden size, low-rank query and output projections and few experts; same run.
CommStats phases: "indexer" (the CSA indexer's entries: halo and all-gather), "compressed" (the CSA and
HCA entries: halos, all-gather, and the backward's all-reduce of their gradients: burst/integrations/
transformers/layers/compressed.py), "forward" and "backward" (the sliding window's K, V on the ring).
"""

from __future__ import annotations

import argparse
import copy
import platform
import time

import torch

from burst.launch import spawn_world


def config(family: str = "deepseek_v32", heads: int = 16):
    from burst.bench.hf_zoo import tiny_config

    c = tiny_config(family)
    if family == "deepseek_v4":
        return _v4(c)
    for key, value in {
        "hidden_size": 256,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "kv_lora_rank": 128,
        "q_lora_rank": 128,
        "head_dim": 64,
        "index_head_dim": 128,
        "index_n_heads": 8,
        "index_topk": 256,
        "num_hidden_layers": 2,
        "max_position_embeddings": 1 << 16,
    }.items():
        setattr(c, key, value)
    c.layer_types = ["indexed_attention"] * 2
    return c


def _v4(c, heads: int = 8):
    from transformers import DeepseekV4Config

    published = DeepseekV4Config()
    for key in (
        "head_dim",
        "qk_rope_head_dim",
        "index_head_dim",
        "index_topk",
        "sliding_window",
        "compress_rates",
        "rope_parameters",
    ):
        setattr(c, key, getattr(published, key))
    for key, value in {
        "hidden_size": 256,
        "num_attention_heads": heads,
        "index_n_heads": 8,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 64,
        "num_hidden_layers": 2,
        "max_position_embeddings": 1 << 16,
    }.items():
        setattr(c, key, value)
    c.layer_types = ["compressed_sparse_attention", "heavily_compressed_attention"]
    return c


def _run(rank, world, seq_len, family):
    import transformers
    from transformers import AutoModelForCausalLM

    import burst
    import burst.integrations.transformers as bt
    from burst import layout as layout_mod

    transformers.logging.set_verbosity_error()
    c = config(family)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(c), attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(c), attn_implementation=bt.register(layout="zigzag"))
    model.load_state_dict(eager.state_dict())
    ids = torch.randint(3, c.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    eager_sel, model_sel = _selections(eager), _selections(model)
    with torch.no_grad():
        expected = eager(input_ids=ids, use_cache=False).logits
    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, layout="zigzag", model=model)
    start = time.perf_counter()
    with burst.CommStats() as stats:
        out = model(**batch, use_cache=False)
        out.loss.backward()
    seconds = time.perf_counter() - start
    logits = layout_mod.unshard(out.logits.detach().contiguous(), layout="zigzag", dim=1)
    differ = 0
    for mine, theirs in zip(model_sel[: len(eager_sel)], eager_sel):  # the layers' selections, row by row
        whole = layout_mod.unshard(mine.contiguous(), layout="zigzag", dim=1)
        differ += sum(set(a.tolist()) - {-1} != set(b.tolist()) - {-1} for a, b in zip(whole[0], theirs[0]))
    return {
        "sent": {p: stats.sent(p) for p in PHASES},
        "seconds": seconds,
        "error": (logits - expected).abs().max().item(),
        "rows differing": differ,
        "rows": seq_len * len(eager_sel),
    }


PHASES = ("indexer", "compressed", "forward", "backward")


def _selections(model):
    seen = []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer") and hasattr(module, "index_topk"):  # V3.2's and V4's
            module.register_forward_hook(lambda mod, args, out: seen.append(out))
    return seen


V32_NOTES = [
    "",
    "Per token and layer the indexer sends index_head_dim numbers (128) once; attention's K, V "
    "through the ring are heads x (qk + v) head dims per token (here 16 x 384, at DeepSeek-V3.2's 128 "
    "heads 128 x 384): the indexer's share falls with the head count, about 1/384 of the forward at "
    "full size. MLA's values are padded to the query head dim (192) before they travel, and K, V move "
    "expanded per head: moving the compressed latent (kv_lora_rank + qk_rope numbers per token) and "
    "expanding on arrival would cut attention's bytes by about heads x 384 / 576, not done yet. The "
    "planner counts the indexer's keys (burst.plan.sparse; `burst plan --hf-config`).",
    "",
    "Selections: in these runs every row whose top-k set is unique got exactly one process's. A row "
    "with fewer than index_topk positive scores (the indexer's ReLU leaves many exact zeros) ties at the "
    "boundary, and torch.topk breaks exact ties in an order that depends on the last bits of the row's "
    "other scores, which a shard's matmul need not reproduce: such a row may attend an equally-scored "
    "other key (found in the 2-rank, 2048-token run: layer 1, row 1498, 9 of its 256 keys, all with "
    "index score 0.0 in both runs; that one row is the logits error there).",
]


V4_NOTES = [
    "",
    "Per token and layer every rank receives from the others: CSA entries head_dim / 4 = 128 numbers, the "
    "indexer's entries index_head_dim / 4 = 32 and HCA entries head_dim / 128 = 4, once per layer, plus the "
    "halo a chunk needs (CSA: the 4-token window before it; HCA: none, the chunks hold whole windows); in the "
    "backward the entries' gradients return by an all-reduce of the gathered entries (counted under "
    "compressed). The ring carries only the sliding window (128 tokens): burst serves a neighbour just the "
    "rows the window needs, so its bytes stay the same as the sequence and the world grow, while the entries "
    "grow with the sequence: at these shapes they pass the ring's forward bytes already at 2048 tokens, and "
    "at long sequences they are most of what a rank sends (the planner counts them: burst.plan.sparse). "
    "K = V in DeepSeek-V4: the layer passes one tensor as both, and one block travels (ring's backward: one "
    "gradient too). "
    "With one K, V head and many query heads, burst's backward (moving queries of every head) sends more "
    "than ring's would (K, V of one head), as the planner's model has it.",
    "",
    "Selections: compared row by row as for DeepSeek-V3.2 (the chosen entries, -1 slots dropped): no row "
    "differed in these runs.",
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("deepseek_v32", "deepseek_v4"), default="deepseek_v32")
    p.add_argument("--seq-lens", default="1024,2048")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--out", default="benchmarks/dsa_bytes.md")
    args = p.parse_args()
    rows = []
    for world in map(int, args.worlds.split(",")):
        for n in map(int, args.seq_lens.split(",")):
            r = spawn_world(_run, n, args.family, nproc=world, threads=1)[0]
            rows.append((world, n, r))
            print(world, n, r, flush=True)
    v4 = args.family == "deepseek_v4"
    mib = 1 << 20
    title = (
        "DeepSeek-V4's compressed attention: the entries against attention's traffic"
        if v4
        else "DeepSeek sparse attention: the indexer's keys against attention's traffic"
    )
    family = f" --family {args.family}" if v4 else ""
    lines = [
        f"# {title}",
        "",
        f"Made by `python benchmarks/dsa_bytes.py{family} --seq-lens {args.seq_lens} --worlds {args.worlds}` "
        f"({platform.machine()} CPU, torch {torch.__version__}). "
        + __doc__.split("\n\n")[3 if v4 else 2].replace("\n", " "),
        "",
        "Per rank, one forward + backward of 2 layers (MiB sent by this rank, fp32):",
        "",
        "| ranks | tokens | indexer | compressed entries | attention forward | attention backward | "
        "(indexer + entries) / attention | max logits error | selections differing (rows x layers) | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, n, r in rows:
        s = r["sent"]
        share = (s["indexer"] + s["compressed"]) / max(1, s["forward"] + s["backward"])
        lines.append(
            f"| {world} | {n} | {s['indexer'] / mib:.2f} | {s['compressed'] / mib:.2f} | "
            f"{s['forward'] / mib:.1f} | {s['backward'] / mib:.1f} | {share:.4f} | {r['error']:.1e} | "
            f"{r['rows differing']} of {r['rows']} | {r['seconds']:.1f} |"
        )
    lines += V4_NOTES if v4 else V32_NOTES
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
