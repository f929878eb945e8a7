"""burstengine.md's measured figures (Tables 2, 4, 5; §4.2's fits; Figs. 12 and 14) as Runs, in the
reading of its setup that burst/plan/paper_runs.py states.
"""

from __future__ import annotations

from .paper_run import K, M, Run


def _be(label, strategy, gpus, model, seq, metric, value, group="", **kw):
    return Run("burstengine.md", label, strategy, gpus, "A800", model, seq, metric, value, group, **kw)


# burstengine.md Table 2: 14B, 1M tokens, 32 A800 (TGS and memory per row)
_T2 = [
    ("T2 baseline (ring, full ckpt)", "ring:flat", dict(checkpointing="full", fused_loss=False), 83.79, 48.47),
    ("T2 + backward optimisation", "burst:flat", dict(checkpointing="full", fused_loss=False), 87.48, 49.31),
    ("T2 + topology-aware ring", "burst", dict(checkpointing="full", fused_loss=False), 95.06, 48.97),
    ("T2 + fused LM head and loss", "burst", dict(checkpointing="full"), 94.81, 41.45),
    ("T2 + sequence-level selective", "burst", dict(checkpointing="selective"), 108.82, 45.93),
    ("T2 + selective++ (remat)", "burst", dict(checkpointing="remat"), 117.83, 53.91),
]

RUNS: list[Run] = []
for label, strategy, kw, tgs, mem in _T2:
    RUNS.append(_be(label, strategy, 32, "llama-14b", M, "tgs", tgs, "BE T2", **kw))
    RUNS.append(_be(label, strategy, 32, "llama-14b", M, "mem_gb", mem, **kw))
# Table 4: 32K tokens per GPU over 2, 4, 8 nodes (14B)
for nodes, tgs, mem in ((2, 223.25, 63.13), (4, 118.36, 53.96), (8, 60.49, 50.96)):
    RUNS.append(
        _be(
            f"T4 {nodes} nodes, {nodes * 8 * 32 / 1024:g}M",
            "burst",
            8 * nodes,
            "llama-14b",
            nodes * 8 * 32 * K,
            "tgs",
            tgs,
        )
    )
    RUNS.append(
        _be(
            f"T4 {nodes} nodes, {nodes * 8 * 32 / 1024:g}M",
            "burst",
            8 * nodes,
            "llama-14b",
            nodes * 8 * 32 * K,
            "mem_gb",
            mem,
        )
    )
# Table 5: one node, CP = 1..8 (dp = 8 / CP), optimizer offloaded
for cp, tgs, mem in ((1, 1201.14, 57.71), (2, 928.24, 55.18), (4, 639.43, 55.58), (8, 393.44, 53.56)):
    for metric, value in (("tgs", tgs), ("mem_gb", mem)):
        RUNS.append(
            _be(
                f"T5 CP {cp}, {cp * 32}K",
                "burst",
                8,
                "llama-14b",
                cp * 32 * K,
                metric,
                value,
                dp=8 // cp,
                offload_optimizer=True,
            )
        )
# §4.2: what trained and what ran out of memory (fits: 1 = trained, 0 = out of memory)
for model, gpus, seq in (
    ("llama-7b", 32, 2 * M),
    ("llama-14b", 32, M),
    ("llama-7b", 64, 4 * M),
    ("llama-14b", 64, 2 * M),
):
    RUNS.append(_be(f"§4.2 BurstEngine {model} {seq // M}M", "burst", gpus, model, seq, "fits", 1))
for model, seq in (("llama-7b", 2 * M), ("llama-14b", M)):
    RUNS.append(
        _be(
            f"§4.2 Megatron-CP {model} {seq // M}M (no FSDP)",
            "ring:flat",
            32,
            model,
            seq,
            "fits",
            0,
            checkpointing="full",
            fused_loss=False,
            fsdp=False,
        )
    )
RUNS.append(
    _be(
        "§4.2 DeepSpeed-Ulysses 14B 1M (40 heads)",
        "ulysses",
        32,
        "llama-14b",
        M,
        "fits",
        0,
        checkpointing="full",
        fused_loss=False,
    )
)
for model, seq in (("llama-7b", 4 * M), ("llama-14b", 2 * M)):
    for strategy, name in (("usp", "usp"), ("ring", "ring-double-ring")):
        RUNS.append(
            _be(
                f"§4.2 LoongTrain {name} {model} {seq // M}M",
                strategy,
                64,
                model,
                seq,
                "fits",
                0,
                checkpointing="full",
                fused_loss=False,
                backward_overlap=strategy == "usp",
            )
        )
# §4.2 / Fig. 12 in words: BurstEngine 1.19x / 1.15x LoongTrain-USP's TGS; USP > DoubleRing > Ulysses (7B)
for model, seq, speedup in (("llama-7b", 2 * M, 1.19), ("llama-14b", M, 1.15)):
    RUNS.append(_be(f"Fig. 12 BurstEngine {model}", "burst", 32, model, seq, "speedup", speedup, f"BE Fig12 {model}"))
    RUNS.append(
        _be(
            f"Fig. 12 LoongTrain-USP {model}",
            "usp",
            32,
            model,
            seq,
            "speedup",
            1.0,
            f"BE Fig12 {model}",
            checkpointing="full",
            fused_loss=False,
        )
    )
RUNS.append(
    _be(
        "Fig. 12 LoongTrain-DoubleRing llama-7b (order only)",
        "ring",
        32,
        "llama-7b",
        2 * M,
        "speedup",
        0.9,
        "BE Fig12 order 7B",
        checkpointing="full",
        fused_loss=False,
        backward_overlap=False,
    )
)
RUNS.append(
    _be(
        "Fig. 12 DeepSpeed-Ulysses llama-7b (order only)",
        "ulysses",
        32,
        "llama-7b",
        2 * M,
        "speedup",
        0.8,
        "BE Fig12 order 7B",
        checkpointing="full",
        fused_loss=False,
    )
)
RUNS.append(
    _be(
        "Fig. 12 LoongTrain-USP llama-7b (order only)",
        "usp",
        32,
        "llama-7b",
        2 * M,
        "speedup",
        1.0,
        "BE Fig12 order 7B",
        checkpointing="full",
        fused_loss=False,
    )
)
# §4.3 / Fig. 14, attention alone (14B's attention, 32 A100, 1M): 1.05x USP, 1.33x DoubleRing
for strategy, name, speedup in (
    ("burst", "burst-double-ring", 1.33),
    ("usp", "usp", 1.33 / 1.05),
    ("ring", "ring-double-ring", 1.0),
):
    RUNS.append(
        Run(
            "burstengine.md",
            f"Fig. 14 attention {name}",
            strategy,
            32,
            "A100",
            "llama-14b",
            M,
            "speedup",
            speedup,
            "BE Fig14",
            attention_only=True,
        )
    )
