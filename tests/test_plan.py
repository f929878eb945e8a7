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

from burst.api import _prepare_call
from burst.plan import Cluster, Workload, choose, estimate, plan, profile
from burst.plan import papers
from burst.plan.cost import STRATEGIES, _ring_pass

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
        block = 2 * n * 64 * 2                # K and V of one head, bf16
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
    flat, double = estimate("burst", slow, w), estimate("burst-double-ring", slow, w)
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
        walls = [estimate(strategy, Cluster(gpus, per_node, H100, inter_bw=bw * 1e9), base).wall_s
                 for bw in (0.1, 1, 10, 100)]
        assert all(a >= b for a, b in zip(walls, walls[1:])), (strategy, walls)
        mems = [estimate(strategy, Cluster(gpus, per_node, H100), replace(base, seq_len=n)).mem_bytes_per_device
                for n in (16384, 65536, 262144)]
        assert all(a <= b for a, b in zip(mems, mems[1:])), (strategy, mems)


def test_plan_ranks_fitting_first_and_flags_what_cannot_run():
    rows = plan(Cluster(32, 8, profile("A800")), Workload(seq_len=1 << 20, heads=40, head_dim=128, layers=40))
    fits = [r.fits for r in rows]
    assert fits == sorted(fits, reverse=True)
    ulysses = next(r for r in rows if r.strategy == "ulysses")
    assert not ulysses.fits and "heads" in ulysses.note  # 40 heads over 32 ranks
    allgather = next(r for r in rows if r.strategy == "allgather")
    assert not allgather.fits  # the whole sequence's K, V does not fit


def test_auto_picks_a_strategy_that_takes_the_call():
    q, kv = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 2, 16)
    for layout in ("contiguous", "zigzag", "striped"):
        for causal in (False, True):
            name, _ = _prepare_call(q, kv, kv, None, 0, 1, "auto", layout, causal, None, None, None, None, {})
            if name == "distflash":
                assert layout == "contiguous" and causal
    assert choose(Cluster(8, 8, H100), Workload(seq_len=8192, heads=8, head_dim=64, causal=False),
                  ["distflash", "ring"]) == "ring"  # distflash is causal only


def test_cli_json_rows():
    done = subprocess.run([sys.executable, "-m", "burst", "plan", "--gpus", "16", "--gpus-per-node", "8", "--profile",
                           "H100", "--seq-len", "131072", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
                           "--causal", "--inter-node-gbps", "25", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {r["strategy"] for r in rows} == set(STRATEGIES)
    for r in rows:
        assert {"strategy", "fits", "wall_s", "mem_bytes_per_device", "inter_node_bytes_per_device"} <= set(r)
