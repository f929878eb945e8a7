"""Live heap at the peak of a sharded attention call, in shard-sized units: what the algorithm holds.

RSS (run_memory.sh) also counts what glibc keeps after frees and fixed per-process costs; this counts
the bytes malloc has handed out and not got back (glibc mallinfo2), read after every tensor op by
burst.bench.memory.HeapPeak (the ruler of benchmarks/engine_memory.py).

    .venv/bin/python benchmarks/live_heap.py [--tokens 16384] [--worlds 1,2,4,8] [--strategies burst,ring]

A strategy may carry one option: burst:chunk_rows=512, burst:backward_side=keys. --kv-heads fewer than
--heads: grouped heads (K, V with that many heads; the unit stays one rank's q shard).

One unit = one shard of q (tokens/G x heads x dim x 4 bytes). The caller's q, k, v and dO are 4 units,
the output 1, the gradients 3: 8 units are the floor for any strategy. Linux/glibc only.
"""

from __future__ import annotations

import argparse

import torch


def measure(rank, world, tokens, heads, dim, strategies, causal=True, kv_heads=None):
    """On one rank of a world: per strategy, (live-heap peak, units sent forward, units sent backward)
    of one forward + backward after a warm-up pass, in units of one rank's q shard."""
    import burst
    from burst.bench.memory import HeapPeak, live_heap_bytes

    unit = tokens // world * heads * dim * 4
    gen = torch.Generator().manual_seed(rank)
    results = {}
    for strategy in strategies:
        # A warm-up pass first: the first backward leaves ~12 MiB of autograd/thread state behind.
        for measured in (False, True):
            q, dout = (torch.randn(1, tokens // world, heads, dim, generator=gen) for _ in range(2))
            k, v = (torch.randn(1, tokens // world, kv_heads or heads, dim, generator=gen) for _ in range(2))
            for t in (q, k, v):
                t.requires_grad_()
            kv_units = 2 * (kv_heads or heads) / heads
            base = live_heap_bytes() - (2 + kv_units) * unit  # count the caller's q, k, v, dout as what they are
            with burst.CommStats() as stats, HeapPeak() as ruler:
                burst.attention(q, k, v, causal=causal, **_strategy_kwargs(strategy)).backward(dout)
            if measured:
                results[strategy] = (
                    (max(ruler.peak.values()) - base) / unit,
                    stats.sent("forward") / unit,
                    stats.sent("backward") / unit,
                )
            del q, k, v, dout
    return results


def _strategy_kwargs(name: str) -> dict:
    """ "burst:chunk_rows=512" -> strategy burst with chunk_rows=512 (one option after ":", an int or a word)."""
    strategy, _, option = name.partition(":")
    if not option:
        return {"strategy": strategy}
    key, value = option.split("=")
    return {"strategy": strategy, key: int(value) if value.isdigit() else value}


def measure_worlds(worlds, tokens, heads, dim, strategies, causal=True, kv_heads=None):
    """{world: [measure's result of each rank]}, one local world (1 thread per rank) per size."""
    from burst.launch import spawn_world

    return {
        world: spawn_world(measure, tokens, heads, dim, strategies, causal, kv_heads, nproc=world, threads=1)
        for world in worlds
    }


def _one_process_sdpa(tokens, heads, dim, kv_heads=None) -> float:
    """The same count for one process running SDPA on the whole sequence, in the same units (G=1)."""
    import threading
    import time
    import torch.nn.functional as F

    from burst.bench.memory import live_heap_bytes as live

    torch.set_num_threads(1)
    peak, stop = [0], threading.Event()
    unit = tokens * heads * dim * 4

    def sample():  # SDPA's peak is inside one op, where HeapPeak does not look: sample instead
        while not stop.is_set():
            peak[0] = max(peak[0], live())
            time.sleep(0.0002)

    for measured in (False, True):
        q, dout = (torch.randn(1, heads, tokens, dim) for _ in range(2))
        k, v = (torch.randn(1, kv_heads or heads, tokens, dim) for _ in range(2))
        for t in (q, k, v):
            t.requires_grad_()
        base, peak[0] = live() - (2 + 2 * (kv_heads or heads) / heads) * unit, 0
        sampler = threading.Thread(target=sample)
        sampler.start()
        gqa = {"enable_gqa": True} if kv_heads and kv_heads != heads else {}
        F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa).backward(dout)
        stop.set()
        sampler.join()
        stop.clear()
        del q, k, v, dout
    return (peak[0] - base) / unit


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=None, help="K, V heads (default: --heads)")
    parser.add_argument("--worlds", default="1,2,4,8")
    parser.add_argument("--strategies", default="burst,ring")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    results = measure_worlds(worlds, args.tokens, args.heads, args.dim, strategies, kv_heads=args.kv_heads)
    sdpa = _one_process_sdpa(args.tokens, args.heads, args.dim, args.kv_heads)
    print(
        f"Live heap at the peak, causal, {args.tokens} tokens, {args.heads} heads "
        f"({args.kv_heads or args.heads} KV heads), dim {args.dim}, fp32, "
        f"in units of one rank's q shard (max over ranks). One process SDPA: {sdpa:.1f} units of the "
        f"whole q.\n"
    )
    print("| G | strategy | units per rank | vs one process SDPA | x G |")
    print("|---|---|---|---|---|")
    for world in worlds:
        for strategy in strategies:
            units = max(rank_results[strategy][0] for rank_results in results[world])
            ratio = units / world / sdpa
            print(f"| {world} | {strategy} | {units:.1f} | {ratio:.2f} | {ratio * world:.2f} |")


if __name__ == "__main__":
    main()
