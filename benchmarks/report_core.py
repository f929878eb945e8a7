"""Turn benchmarks/core/*.json into the Markdown report benchmarks/core.md (and a plot if matplotlib is there)."""

import json
import os

here = os.path.dirname(os.path.abspath(__file__))


def load(name):
    with open(os.path.join(here, "core", name)) as f:
        return json.load(f)


print("# Core strategies on 2 CPU ranks vs one process\n")
print("Command: `bash benchmarks/run_core.sh` (2 ranks x 1 thread, gloo; yardstick: one process x 2 threads")
print("running `torch.nn.functional.scaled_dot_product_attention` forward+backward on the whole sequence).")
print("fp32, batch 1, 8 heads, head dim 64. `vs SDPA` = SDPA's fwd+bwd time / the strategy's (higher is better).")
print("Bytes are what one rank sent. Peak memory is the peak RSS of the process above a bare process (torch loaded,")
print("no tensors): this rank's inputs, outputs, gradients and working memory.\n")
print("Runs marked `older` predate the `git_commit` field (commit f5b3ebd's harness): their ranks drew the whole")
print("sequence before cutting their shard, which inflates their peak memory; the memory table below is the")
print("corrected measurement.\n")
print(
    "| tokens | mask | strategy | fwd s | bwd s | vs SDPA | fwd MiB sent | bwd MiB sent | peak MiB/rank "
    "| SDPA peak MiB | max err | commit |"
)
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for n in (8192, 16384, 32768):
    for mask in ("full", "causal"):
        path = f"{mask}_{n}.json"
        if not os.path.exists(os.path.join(here, "core", path)):
            continue
        r = load(path)
        base = r["sdpa_single_process"]
        for s in r["strategies"]:
            print(
                f"| {n} | {mask} | {s['strategy']} | {s['fwd_s']:.2f} | {s['bwd_s']:.2f} | {s.get('vs_sdpa', 0):.2f} | "
                f"{s['sent_fwd_per_rank'] / 2**20:.0f} | {s['sent_bwd_per_rank'] / 2**20:.0f} | "
                f"{s['peak_mem_per_rank'] / 2**20:.0f} | {base['peak_mem_bytes'] / 2**20:.0f} | {s['max_err']:.1e} | "
                f"{r.get('git_commit') or 'older'} |"
            )
print("\n## Re-check after the 1024-row kernel calls (16K, 2 ranks x 1 thread, 3 repeats)\n")
print("Same command as above with `--repeats 3`, plus `--causal --layout zigzag` for the second file.\n")
print("| run | strategy | fwd s | bwd s | vs SDPA | SDPA fwd+bwd s | commit |")
print("|---|---|---|---|---|---|---|")
LABELS = {
    "_burst": " (after the dQ change)",
    "_agreement_2": " (same, run again)",
    "_double_ring": " (ring and burst on the double-ring driver)",
    "_agreement": " (after the agreement check and strided inputs)",
    "_chunk_stream": " (burst's backward on the chunk stream)",
    "_own_block": " (chunk stream, own block in one chunk)",
    "_schedules_2": " (same, run again)",
    "_exact_cuts_2": " (same, run again)",
    "_exact_cuts": " (after comm.tagged and the masks' exact cuts)",
    "_served_forward": " (burst's forward on served key chunks)",
    "_host_channels": " (CPU messages through shared memory, 128-row chunks at least)",
    "_schedules": " (after the issue-25 layout: schedules/, typed options, validation.py)",
    "_session13_before": " (2026-11-29, a slower machine: the code before that session, a2d0b24)",
    "_session13": " (2026-11-29, the same machine: that session's code)",
}
for name in (
    "recheck_full_16384.json",
    "recheck_zigzag_16384.json",
    "recheck_full_16384_burst.json",
    "recheck_zigzag_16384_burst.json",
    "recheck_full_16384_agreement.json",
    "recheck_zigzag_16384_agreement.json",
    "recheck_zigzag_16384_agreement_2.json",
    "recheck_full_16384_double_ring.json",
    "recheck_zigzag_16384_double_ring.json",
    "recheck_zigzag_16384_chunk_stream.json",
    "recheck_full_16384_own_block.json",
    "recheck_zigzag_16384_own_block.json",
    "recheck_full_16384_schedules.json",
    "recheck_zigzag_16384_schedules.json",
    "recheck_zigzag_16384_schedules_2.json",
    "recheck_full_16384_exact_cuts.json",
    "recheck_zigzag_16384_exact_cuts.json",
    "recheck_full_16384_exact_cuts_2.json",
    "recheck_zigzag_16384_served_forward.json",
    "recheck_full_16384_host_channels.json",
    "recheck_zigzag_16384_host_channels.json",
    "recheck_full_16384_session13_before.json",
    "recheck_full_16384_session13.json",
    "recheck_zigzag_16384_session13.json",
):
    if os.path.exists(os.path.join(here, "core", name)):
        r = load(name)
        base = r["sdpa_single_process"]
        for s in r["strategies"]:
            label = name[8:-5]
            for suffix, words in LABELS.items():
                label = label.replace(suffix, words)
            print(
                f"| {label} | {s['strategy']} | {s['fwd_s']:.2f} | {s['bwd_s']:.2f} | {s['vs_sdpa']:.2f} | "
                f"{base['fwd_s'] + base['bwd_s']:.2f} | {r['git_commit']} |"
            )


def memory_table(tokens, suffix, title):
    print(f"\n## Peak memory per rank as G grows ({tokens // 1024}K tokens, causal, fp32): {title}\n")
    print("| G | strategy | peak MiB/rank | vs one process | x G | sent fwd MiB | sent bwd MiB | commit |")
    print("|---|---|---|---|---|---|---|---|")
    single = None
    for g in (1, 2, 4, 8):
        path = os.path.join(here, "core", f"mem_{tokens}_g{g}{suffix}.json")
        if not os.path.exists(path):
            continue
        r = json.load(open(path))
        if r["sdpa_single_process"]:
            single = r["sdpa_single_process"]["peak_mem_bytes"]
            print(f"| 1 | sdpa (one process) | {single / 2**20:.0f} | 1.00 | 1.00 | - | - | {r['git_commit']} |")
        for s in r["strategies"]:
            ratio = s["peak_mem_per_rank"] / single if single else float("nan")
            print(
                f"| {g} | {s['strategy']} | {s['peak_mem_per_rank'] / 2**20:.0f} | {ratio:.2f} | {ratio * g:.2f} | "
                f"{s['sent_fwd_per_rank'] / 2**20:.0f} | {s['sent_bwd_per_rank'] / 2**20:.0f} | {r['git_commit']} |"
            )


print("\nCommand: `bash benchmarks/run_memory.sh`. G ranks x 1 thread; G=4 and G=8 share 2 cores, so only their")
print("memory means something. Peak RSS above a bare process (torch loaded, gloo up, no tensors). `x G` is")
print("the ratio to one process times G: constant when memory per rank falls as 1/G.")
memory_table(16384, "", "glibc malloc as it comes")
memory_table(16384, "_mmap", "MALLOC_MMAP_THRESHOLD_=1048576 (freed large blocks return to the OS)")
memory_table(32768, "_mmap", "MALLOC_MMAP_THRESHOLD_=1048576")
print(open(os.path.join(here, "memory_notes.md")).read())
