"""burst.plan: the cost model against the papers' formulas, its monotonicity, auto, and `burst plan`.

Single process; no world needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from burst.call import AttentionRequest
from burst.plan import Cluster, Workload, choose, estimate, papers, plan, profile
from burst.plan.auto import auto_choice
from burst.plan.cost import STRATEGIES, _ring_pass
from burst.validation import checked_call

H100 = profile("H100")


def test_ring_attention_table2_minimal_block_and_sequence():
    """ring-attention.md Table 2: c = F/B, s = 6c, as printed (the paper rounds to one decimal)."""
    for hardware, (tflops, gbps, block, seq) in papers.RING_ATTENTION_TABLE2.items():
        c = papers.min_block_size(tflops * 1e12, gbps * 1e9)
        assert c == pytest.approx(block, rel=0.05), hardware
        assert papers.min_sequence_length(tflops * 1e12, gbps * 1e9) == pytest.approx(seq, rel=0.05), hardware


def test_model_hides_the_ring_exactly_above_the_minimal_block():
    """The model's forward ring (4·n²·d FLOPs against 4·n·d bytes per head and step, bf16) hides its
    transfers when the block is above ring-attention.md's F/B and exposes them below."""
    flops, bw = 312e12, 12.5e9
    prof = replace(H100, flops=flops, inter_bw=bw, intra_bw=bw, intra_latency=0.0, inter_latency=0.0)
    cluster = Cluster(gpus=8, gpus_per_node=1, profile=prof)
    c_min = papers.min_block_size(flops, bw)
    for factor, hidden in ((1.25, True), (0.8, False)):
        n = int(c_min * factor)
        compute = 8 * 4 * n * n * 64 / flops  # 8 steps of one head, d = 64
        block = 2 * n * 64 * 2  # K and V of one head, bf16
        wall, link, exposed, _, _ = _ring_pass(cluster, 8, compute, block, double=False)
        assert (exposed == pytest.approx(0.0, abs=1e-12)) == hidden, (factor, exposed, link)


def test_burstattention_table1_volumes():
    """Per-device elements of the model tend (as G grows) to burstattention.md Table 1's per-device
    volumes (forward 2BZNd, burst's backward 3BZNd + 2BZN) and to burstengine.md's 4Nd for
    RingAttention's backward (the BurstAttention paper's 6BZNd counts K and V in separate rounds)."""
    B, Z, N, d, G = 1, 8, 1 << 20, 64, 1024
    fp32 = replace(profile("local"), memory_bytes=1e15)
    cluster = Cluster(gpus=G, gpus_per_node=G, profile=fp32)
    w = Workload(seq_len=N, heads=Z, head_dim=d, batch=B, causal=False, dtype_bytes=4)
    paper = papers.burstattention_volumes(B, Z, N, d)
    burst = estimate("burst", cluster, w).intra_node_bytes_per_device / 4
    ring = estimate("ring", cluster, w).intra_node_bytes_per_device / 4
    assert burst == pytest.approx(sum(paper["BurstAttention"]), rel=2e-3)
    assert ring == pytest.approx(paper["BurstAttention"][0] + 4 * B * Z * N * d, rel=2e-3)
    assert burst / ring == pytest.approx((5 * d + 2) / (6 * d), rel=2e-3)


def test_burstengine_table1_ordering_and_link_bytes():
    """burstengine.md Table 1: with intra faster than inter, BurstAttention's time < DoubleRing's <
    RingAttention's; the model's double ring sends (nodes - 1) blocks inter-node where the flat
    ring's boundary rank sends G - 1, and is not slower."""
    t = papers.burstengine_comm_time(G=32, n_inter=4, t_intra=1.0, t_inter=8.0)
    assert t["BurstAttention"] < t["DoubleRing"] < t["RingAttention"]
    slow = Cluster(gpus=8, gpus_per_node=4, profile=H100, inter_bw=1e9)
    w = Workload(seq_len=32768, heads=8, head_dim=64, causal=False)
    flat, double = estimate("burst:flat", slow, w), estimate("burst", slow, w)
    block = 2 * (32768 / 8) * 8 * 64 * 2
    fwd_inter_double = (slow.nodes - 1) * block
    assert double.inter_node_bytes_per_device < flat.inter_node_bytes_per_device
    assert flat.inter_node_bytes_per_device >= (8 - 1) * block
    assert double.inter_node_bytes_per_device >= fwd_inter_double
    assert double.wall_s < flat.wall_s


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_monotone_in_bandwidth_and_sequence(strategy):
    base = Workload(seq_len=65536, heads=8, head_dim=128, kv_heads=8, layers=2, causal=True)
    for gpus, per_node in ((8, 8), (16, 4)):
        walls = [
            estimate(strategy, Cluster(gpus, per_node, H100, inter_bw=bw * 1e9), base).wall_s
            for bw in (0.1, 1, 10, 100)
        ]
        assert all(a >= b for a, b in zip(walls, walls[1:])), (strategy, walls)
        mems = [
            estimate(strategy, Cluster(gpus, per_node, H100), replace(base, seq_len=n)).mem_bytes_per_device
            for n in (16384, 65536, 262144)
        ]
        assert all(a <= b for a, b in zip(mems, mems[1:])), (strategy, mems)


def test_plan_ranks_fitting_first_and_flags_what_cannot_run():
    rows = plan(Cluster(32, 8, profile("A800")), Workload(seq_len=1 << 20, heads=40, head_dim=128, layers=40))
    fits = [r.fits for r in rows]
    assert fits == sorted(fits, reverse=True)
    ulysses = next(r for r in rows if r.strategy == "ulysses")
    assert not ulysses.fits and "heads" in ulysses.note  # 40 heads over 32 ranks
    allgather = next(r for r in rows if r.strategy == "allgather")
    assert not allgather.fits  # the whole sequence's K, V does not fit


def test_the_plan_says_what_burst_attention_would_run():
    """The planner ranked distflash first for a windowed contiguous causal call that burst.attention refuses, and
    costed USP at a Ulysses degree that does not split the KV heads (40 / 10 heads on nodes of 8: burst runs 2)."""
    from burst.strategies.usp import default_degree

    cluster = Cluster(4, 4, profile("H100"))
    windowed = Workload(
        seq_len=1 << 17, heads=32, kv_heads=8, head_dim=128, causal=True, layout="contiguous", window=4096
    )
    distflash = next(r for r in plan(cluster, windowed) if r.strategy == "distflash")
    assert not distflash.fits and "no window" in distflash.note
    phi3 = Workload(seq_len=1 << 17, heads=40, kv_heads=10, head_dim=128, causal=True)
    usp = next(r for r in plan(Cluster(16, 8, profile("H100")), phi3) if r.strategy == "usp")
    assert default_degree(40, 10, 8, 16) == 2 and "ulysses 2 x ring 8" in usp.note, usp.note
    # its ring's members sit u ranks apart, P/u to a node of P: on one node nothing crosses (the ring had been
    # costed as one member to a node, every hop on the inter-node link)
    one_node = next(r for r in plan(Cluster(6, 6, profile("H100")), phi3) if r.strategy == "usp")
    assert one_node.inter_node_bytes_per_device == 0 and one_node.intra_node_bytes_per_device > 0, one_node


def test_auto_picks_a_strategy_that_takes_the_call():
    q, kv = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 2, 16)
    for layout in ("contiguous", "zigzag", "striped"):
        for causal in (False, True):
            request = AttentionRequest(strategy="auto", layout=layout, causal=causal)
            name, _ = checked_call(q, kv, kv, request, 0, 1, auto=auto_choice)
            if name == "distflash":
                assert layout == "contiguous" and causal
    assert (
        choose(Cluster(8, 8, H100), Workload(seq_len=8192, heads=8, head_dim=64, causal=False), ["distflash", "ring"])
        == "ring"
    )  # distflash is causal only


def test_cli_json_rows():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "burst",
            "plan",
            "--gpus",
            "16",
            "--gpus-per-node",
            "8",
            "--profile",
            "H100",
            "--seq-len",
            "131072",
            "--heads",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--causal",
            "--inter-node-gbps",
            "25",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {r["strategy"] for r in rows} == set(STRATEGIES)
    for r in rows:
        assert {"strategy", "fits", "wall_s", "mem_bytes_per_device", "inter_node_bytes_per_device"} <= set(r)


# --- the whole model (model_cost.py) ---

from burst.cli import main  # noqa: E402
from burst.engine.model import PRESETS  # noqa: E402
from burst.plan import Training, attention_step, model_config, whole_model  # noqa: E402
from burst.plan.model_cost import CHECKPOINTING, activation_bytes_per_token  # noqa: E402

A800 = profile("A800")


def test_presets_are_the_engine_configs_and_the_papers_models():
    assert model_config("llama-7b") is PRESETS["llama-7b"] and model_config("llama-14b") is PRESETS["llama-14b"]
    m3 = model_config("llama-3b")
    assert (m3.layers, m3.heads, m3.head_dim) == (26, 32, 100)  # OpenLLaMA-3B
    m14 = model_config("llama-14b")
    assert (m14.layers, m14.heads, m14.head_dim) == (40, 40, 128)  # burstengine.md §4.1's 14B


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_whole_model_monotone(strategy):
    """More bandwidth never slower; a longer sequence never less memory; more checkpointing never
    more activation memory (none > remat > selective > full), and never faster."""
    m = model_config("llama-7b")
    layout = "contiguous" if strategy == "distflash" else "zigzag"
    for mode in ("train", "prefill"):
        t = Training(m, 1 << 18, mode=mode, layout=layout)
        steps = [
            whole_model(strategy, Cluster(16, 8, A800, inter_bw=bw * 1e9, intra_bw=bw * 4e9), t).wall_s
            for bw in (1, 5, 25, 100)
        ]
        assert all(a >= b for a, b in zip(steps, steps[1:])), (mode, steps)
        mems = [
            whole_model(strategy, Cluster(16, 8, A800), replace(t, seq_len=n)).mem_bytes_per_device
            for n in (1 << 16, 1 << 18, 1 << 20)
        ]
        assert all(a <= b for a, b in zip(mems, mems[1:])), (mode, mems)
    by_mode = {
        c: whole_model(strategy, Cluster(16, 8, A800), Training(m, 1 << 18, checkpointing=c, layout=layout))
        for c in CHECKPOINTING
    }
    kept = [by_mode[c].extra["memory"]["kept_activations"] for c in ("none", "remat", "selective", "full")]
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
    steps = [by_mode[c].wall_s for c in ("none", "remat", "selective", "full")]
    assert steps == sorted(steps)
    assert activation_bytes_per_token(m, "full", 2) == 2 * m.dim


def test_fits_is_decided_by_whole_model_memory():
    """burstengine.md §4.2: BurstEngine trained 7B at 2M tokens on 32 A800; without FSDP the 14B's
    states alone (16 bytes per parameter) exceed 80 GB; a small --gpu-mem-gib flips the verdict."""
    t = Training(model_config("llama-7b"), 1 << 21, checkpointing="remat")
    est = whole_model("burst", Cluster(32, 8, A800), t)
    assert est.fits and est.mem_bytes_per_device < A800.memory_bytes
    assert not whole_model("burst", Cluster(32, 8, A800), t, memory_bytes=30 * 2**30).fits
    no_fsdp = whole_model("ring", Cluster(32, 8, A800), Training(model_config("llama-14b"), 1 << 20, fsdp=False))
    assert not no_fsdp.fits and no_fsdp.extra["memory"]["states"] > 16 * 13e9
    fused = whole_model("burst", Cluster(8, 8, A800), Training(model_config("llama-14b"), 1 << 18))
    unfused = whole_model("burst", Cluster(8, 8, A800), Training(model_config("llama-14b"), 1 << 18, fused_loss=False))
    # the full logits (32K tokens per device, bf16) against one 4096-token fp32 chunk of them
    assert unfused.mem_bytes_per_device - fused.mem_bytes_per_device == pytest.approx((32768 * 2 - 4096 * 4) * 120000)


def test_overlap_is_not_perfect_and_prefill_is_cheaper():
    """A hidden ring still costs (contention, per-layer sync); a prefill is one forward, no optimizer."""
    w = Workload(seq_len=1 << 20, heads=40, head_dim=128, layers=40)
    raw, real = estimate("burst", Cluster(32, 8, A800), w), attention_step("burst", Cluster(32, 8, A800), w)
    assert real.wall_s > raw.wall_s
    t = Training(model_config("llama-14b"), 1 << 20)
    train, prefill = (
        whole_model("burst", Cluster(32, 8, A800), replace(t, mode=mode)) for mode in ("train", "prefill")
    )
    assert prefill.wall_s < train.wall_s / 2 and prefill.mem_bytes_per_device < train.mem_bytes_per_device
    assert estimate("burst", Cluster(32, 8, A800), replace(w, forward_only=True)).wall_s < raw.wall_s / 3


def test_auto_uses_the_same_model():
    cluster, w = Cluster(32, 8, A800), Workload(seq_len=1 << 18, heads=32, head_dim=128, causal=True)
    picked = choose(cluster, w, ["burst", "ring", "usp", "ulysses"])
    costs = {n: attention_step(n, cluster, w) for n in ("burst", "ring", "usp", "ulysses")}
    assert picked == min(costs, key=lambda n: (not costs[n].fits, costs[n].wall_s, n))


def test_papers_counts_and_every_run_expressible():
    """benchmarks/planner_vs_papers.md's counts, recomputed (a regression guard on the model)."""
    sys.path.insert(0, "benchmarks")
    import planner_vs_papers as report

    rows = report.evaluate()
    absolute, within, verdicts, right, orders = report.counts(rows)
    assert len(within) >= 0.75 * len(absolute), (len(within), len(absolute))
    assert sum(o[3] == o[4] for o in orders) >= 0.85 * len(orders)
    assert len(right) >= 0.7 * len(verdicts)


def test_cli_whole_model(capsys, tmp_path):
    base = ["plan", "--gpus", "32", "--profile", "a800", "--seq-len", "1048576", "--causal"]
    assert main([*base, "--model", "llama-14b", "--checkpointing", "remat", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for r in rows:
        assert {"step_s", "tokens_per_s_per_device", "mem_bytes_per_device", "wall_s", "fits"} <= set(r)
        assert r["scope"] == "whole model"
    burst = next(r for r in rows if r["strategy"] == "burst")
    assert burst["fits"] and burst["tokens_per_s_per_device"] == pytest.approx(118.36, rel=0.25)  # Table 4
    assert (
        main(
            [
                *base,
                "--hidden",
                "5120",
                "--ffn-hidden",
                "13824",
                "--vocab",
                "120000",
                "--heads",
                "40",
                "--layers",
                "40",
                "--mode",
                "prefill",
            ]
        )
        == 0
    )
    assert "whole model" in capsys.readouterr().out
    assert main([*base, "--model", "llama-14b", "--attention-only"]) == 0
    assert "attention only" in capsys.readouterr().out
    assert main([*base, "--model", "llama-7b", "--gpu-mem-gib", "10", "--json", "-"]) == 0
    assert not any(r["fits"] for r in json.loads(capsys.readouterr().out))
    for argv, option in (
        (["--hidden", "4096"], "--ffn-hidden"),
        (["--model", "llama-7b", "--dp", "3"], "--dp"),
        (["--model", "llama-7b", "--head-dim", "64"], "--head-dim"),
        (["--model", "llama-7b", "--checkpointing", "some"], "--checkpointing"),
        (["--model", "llama-7b", "--mode", "decode"], "--mode"),
        (["--model", "gpt-5"], "--model"),
        (["--attention-only", "--heads", "8", "--head-dim", "64"], "--attention-only"),
        (["--model", "llama-7b", "--gpu-mem-gib", "0"], "--gpu-mem-gib"),
        (["--model", "llama-7b", "--kv-heads", "5"], "--kv-heads"),
        (["--model", "llama-7b", "--heads", "7"], "--heads"),
        (["--model", "llama-7b", "--dp", "2", "--attention-only"], "--dp"),
        ([], "--heads"),
    ):
        with pytest.raises(SystemExit) as exited:
            main([*base, *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1, (argv, err)
        assert err[0].startswith(f"burst plan: error: {option}"), (argv, err)


def test_each_papers_command_gives_the_planned_value(capsys):
    """planner_vs_papers.md prints a `burst plan` command per figure: it must give the figure's plan."""
    from burst.plan.paper_runs import RUNS, planned

    for run in RUNS:
        if run.metric in ("over_1gpu", "speedup"):
            continue  # ratios of two plans
        assert main(["plan", *run.argv(), "--json", "-"]) == 0
        row = next(r for r in json.loads(capsys.readouterr().out) if r["strategy"] == run.strategy)
        value, fits = planned(run)
        cli = {
            "tgs": row["tokens_per_s_per_device"],
            "step_s": row["step_s"],
            "prefill_s": row["step_s"],
            "mem_gb": row["mem_bytes_per_device"] / 1e9,
            "fits": float(row["fits"]),
        }[run.metric]
        assert cli == pytest.approx(value, rel=1e-9), run.label
        assert row["fits"] == fits, run.label


def test_sparse_attention_gathers_are_counted(capsys, tmp_path):
    """DeepSeek-V3.2's indexer keys and DeepSeek-V4's compressed entries, from their published configs:
    the numbers per token worked out here by hand, and a plan that gathers them costs more."""
    transformers = pytest.importorskip("transformers")
    from burst.plan.sparse import gathered_numbers

    v4 = getattr(transformers, "DeepseekV4Config", None)
    if v4 is None:
        pytest.skip("this transformers release has no DeepSeek-V4")
    config = v4()
    kinds = config.layer_types
    csa = sum(k == "compressed_sparse_attention" for k in kinds) / len(kinds)
    hca = sum(k == "heavily_compressed_attention" for k in kinds) / len(kinds)
    assert gathered_numbers(config) == pytest.approx((csa * 128 / 4, csa * 512 / 4 + hca * 512 / 128))
    from burst.plan.sparse import entries_per_query

    n = 1 << 20  # a CSA query attends its top 512 entries, an HCA query its (i + 1) // 128: n / 256 on average
    assert entries_per_query(config, n) == pytest.approx(csa * 512 + hca * n / 256)
    assert entries_per_query(transformers.DeepseekV32Config(), n) == 0.0
    from burst.plan.cost import attention_flops
    from burst.plan.sparse import indexer_macs

    v32 = transformers.DeepseekV32Config()  # its indexer scores every earlier token: n / 2 on average
    assert indexer_macs(v32, n) == pytest.approx(v32.index_n_heads * v32.index_head_dim * n / 2)
    assert indexer_macs(config, n) == pytest.approx(csa * 64 * 128 * n / 8)  # V4's CSA layers, the ended entries
    assert indexer_macs(transformers.LlamaConfig(), n) == 0.0
    plain = Workload(seq_len=n, heads=8, head_dim=64)
    (f0, b0), (f1, b1) = attention_flops(plain), attention_flops(replace(plain, indexer_macs=1000.0))
    assert f1 - f0 == pytest.approx(2 * n * 1000.0) and b1 == b0  # forward only: the choice carries no gradient
    v32 = transformers.DeepseekV32Config()
    assert gathered_numbers(v32) == (v32.index_head_dim, 0.0)
    assert gathered_numbers(transformers.LlamaConfig()) == (0.0, 0.0)
    cluster = Cluster(gpus=8, gpus_per_node=8, profile=H100)
    base = Workload(seq_len=1 << 20, heads=64, head_dim=512, kv_heads=1, layers=43, causal=True)
    sparse = replace(base, gathered=14.9, gathered_with_gradient=61.7)
    plain, gathered = estimate("burst", cluster, base), estimate("burst", cluster, sparse)
    assert gathered.comm_s > plain.comm_s and gathered.mem_bytes_per_device > plain.mem_bytes_per_device
    added = gathered.intra_node_bytes_per_device - plain.intra_node_bytes_per_device
    per_rank_tokens = (1 << 20) / 8
    assert added == pytest.approx(43 * 7 * per_rank_tokens * 2 * (14.9 + 61.7 + 2 * 61.7))  # bf16; fwd + bwd
    config.save_pretrained(tmp_path)
    assert main(["plan", "--gpus", "8", "--seq-len", "65536", "--hf-config", str(tmp_path), "--causal"]) == 0
    out = capsys.readouterr().out
    assert "64 heads (1 kv) x 512, 43 layer(s)" in out and "compressed entries" in out
    assert "128-token sliding window" in out and "attends" in out


def test_sliding_windows_are_costed():
    """A causal window: the pairs it leaves (counted here by brute force), balanced contiguous shards,
    a ring that stops after the ranks the window reaches (contiguous) or goes round (zigzag), and a
    model mixing windowed and full layers costed per kind."""
    from burst.plan.windows import causal_pairs, ring_steps

    assert causal_pairs(1000, 100) == sum(min(i + 1, 100) for i in range(1000))
    assert causal_pairs(1000, 5000) == 1000 * 1001 / 2
    n, g, window = 1 << 20, 8, 4096
    assert ring_steps(n, g, window, "contiguous") == 2 and ring_steps(n, g, n // g + 2, "contiguous") == 3
    assert ring_steps(n, g, window, "zigzag") == g and ring_steps(n, g, None, "contiguous") == g
    cluster = Cluster(gpus=g, gpus_per_node=8, profile=H100)
    full = Workload(seq_len=n, heads=32, head_dim=128, kv_heads=8, layers=4, causal=True, layout="contiguous")
    windowed = replace(full, window=window)
    for strategy in ("burst", "ring"):
        a, b = estimate(strategy, cluster, full), estimate(strategy, cluster, windowed)
        assert b.compute_s < a.compute_s / 100  # 4K of 1M keys per query, and no straggler
        assert b.intra_node_bytes_per_device < a.intra_node_bytes_per_device / 3  # one hop instead of seven
        zig = estimate(strategy, cluster, replace(windowed, layout="zigzag"))
        assert zig.compute_s == pytest.approx(b.compute_s)  # balanced either way
        assert zig.intra_node_bytes_per_device > b.intra_node_bytes_per_device  # zigzag's ring goes round
        half = estimate(strategy, cluster, replace(windowed, windowed_share=0.5))
        assert half.compute_s == pytest.approx((a.compute_s + b.compute_s) / 2)
        assert half.wall_s == pytest.approx((a.wall_s + b.wall_s) / 2)
    # burst's chunk stream serves a window only its rows: 127 per rank at 2 ranks, zigzag, 2048 tokens
    # (benchmarks/compressed_bytes.md measured 128 rows of K per layer: the stream's chunk of the window)
    from burst.plan.windows import served_share

    assert served_share(2048, 2, 128, "zigzag") * 1024 == pytest.approx(127)
    zigzag = replace(windowed, layout="zigzag")
    assert (
        estimate("burst", cluster, zigzag).intra_node_bytes_per_device
        < estimate("ring", cluster, zigzag).intra_node_bytes_per_device / 10
    )


def test_cli_window_and_a_config_with_sliding_layers(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    base = ["plan", "--gpus", "8", "--seq-len", "131072", "--heads", "32", "--head-dim", "128"]
    with pytest.raises(SystemExit):
        main([*base, "--window", "4096"])  # a window needs --causal
    assert "--window" in capsys.readouterr().err
    assert main([*base, "--causal", "--window", "4096", "--json", "-"]) == 0
    windowed = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)}
    assert main([*base, "--causal", "--json", "-"]) == 0
    full = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)}
    assert windowed["burst"]["compute_s"] < full["burst"]["compute_s"] / 10
    config = transformers.GptOssConfig()  # sliding and full layers alternating, a 128-token window
    config.save_pretrained(tmp_path)
    assert main(["plan", "--gpus", "8", "--seq-len", "131072", "--hf-config", str(tmp_path), "--causal"]) == 0
    assert "a 128-token sliding window on 50% of the layers" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # without --causal its window had been dropped: planned as full attention
        main(["plan", "--gpus", "8", "--seq-len", "131072", "--hf-config", str(tmp_path)])
    assert "give --causal" in capsys.readouterr().err


def test_mla_latent_is_what_burst_moves():
    """Multi-head latent attention (plan/latent.py): burst's ring moves the latent (576 numbers a token at
    DeepSeek-V3's shapes) instead of 128 expanded heads, and each device pays for expanding the blocks
    it attends; the other strategies keep the expanded heads."""
    from dataclasses import replace

    from burst.plan.cost import Cluster, Workload, estimate
    from burst.plan.latent import LatentShape
    from burst.plan.profiles import profile

    cluster = Cluster(16, 8, profile("H100"))
    expanded = Workload(seq_len=32768, heads=128, head_dim=192, kv_heads=128, causal=True, dtype_bytes=2)
    mla = replace(expanded, latent=LatentShape(rank=512, rope=64, expanded=128 * (128 + 128)))
    burst_expanded, burst_latent = estimate("burst", cluster, expanded), estimate("burst", cluster, mla)
    assert estimate("ring", cluster, mla).row() == estimate("ring", cluster, expanded).row()
    assert burst_latent.inter_node_bytes_per_device < burst_expanded.inter_node_bytes_per_device / 30
    extra = 8.0 * 32768 * 512 * 128 * 256 / 16 / profile("H100").flops  # 2 forward + 6 backward FLOPs a pair
    assert burst_latent.compute_s - burst_expanded.compute_s == pytest.approx(extra, rel=1e-9)
    assert "the latent" in burst_latent.note


@pytest.mark.parametrize("name", ["H100", "H200"])
def test_host_activations_on_the_first_layers_that_fit_the_longest_step(name):
    """`burst plan --longest` for llama3-8b on one GPU beside 128 GiB of host memory (the lent machine):
    AdamW's state on the host takes ~100 GiB, so every layer's checkpoints there fill it before the device
    is full. The planner moves the first N layers' only (best_split) and keeps the rest on the device:
    a longer step than with every layer's on the host or none, and both memories within bounds."""
    from burst.plan.lengths import MEMORY_OPTIONS, longest_length, option_rows

    cluster, model, host = Cluster(1, 1, profile(name)), PRESETS["llama3-8b"], 128 * 2**30
    rows = {r["option"]: r for r in option_rows(model, cluster, host_memory_bytes=host, dtype_bytes=2)}
    split = rows["full + host optimizer + host activations"]
    n = int(split["flags"].split("--offload-layers ")[1])
    assert 0 < n < model.layers, split["flags"]
    fields = MEMORY_OPTIONS["full + host optimizer + host activations"][0]
    every = longest_length(
        "burst", cluster, Training(model, 1024, fsdp=False, host_memory_bytes=host, dtype_bytes=2, **fields)
    )
    assert split["longest"] > max(every, rows["full + host optimizer"]["longest"]), (split, every)
    assert split["host_mem_bytes"] <= host and split["mem_bytes"] <= cluster.profile.memory_bytes
    with pytest.raises(ValueError, match="offload_layers=3: 0 or more, with offload_activations"):
        Training(model, 1024, offload_layers=3).check(1)


def test_the_longest_step_stops_at_the_models_limit():
    """`burst train` refuses a --seq-len past the model's max_seq_len, so --longest never offers one: the
    tiny model fits any length on an A100 and every row stops at its limit, marked so."""
    from burst.plan.lengths import option_rows

    model = PRESETS["tiny"]
    rows = option_rows(model, Cluster(1, 1, profile("A100")), dtype_bytes=2)
    assert all(r["longest"] == model.max_seq_len and r["at_model_limit"] for r in rows), rows


def test_a_calibration_that_burst_bench_did_not_write_is_refused_by_name(tmp_path):
    """A calibration.json without bandwidth raised KeyError, one with zeros ZeroDivisionError, one with negative
    FLOP/s planned negative step times (a helper's probe); each is refused naming the file."""
    from burst.plan.profiles import calibrated_local

    saved = tmp_path / "calibration.json"
    for text in ('{"flops": 1e12}', '{"flops": -5e12, "bandwidth": 1e9}', '{"flops": 1e12, "bandwidth": 0}', "[]", "x"):
        saved.write_text(text)
        with pytest.raises(ValueError, match="calibration"):
            calibrated_local(str(saved))
    saved.write_text('{"flops": 2e12, "bandwidth": 3e9, "latency": 1e-5}')
    local = calibrated_local(str(saved))
    assert (local.flops, local.intra_bw, local.inter_latency) == (2e12, 3e9, 1e-5)
