"""transformers' model.generate() with the prompt sharded across ranks and a sharded KV cache.

    torchrun --nproc-per-node 2 examples/transformers_generate.py [--prompt-len 100] [--new-tokens 16]
    torchrun --nproc-per-node 8 examples/transformers_generate.py --device cuda --prompt-len 65536

A Llama with random weights (from a config, no download). Every rank passes the same whole prompt to
generate() with **bt.sharded_cache(model) (`cache=bt.ShardedCache(model)` on transformers 5.24 and later,
`past_key_values=` before): the prefill runs sequence-parallel (each rank
holds 1/G of the prompt) and every rank keeps ~1/G of the KV cache. Rank 0 prints the new tokens of
each prompt, the same as one process prints (`--nproc-per-node 1`).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import burst.integrations.transformers as bt
from burst.devices import backend_for, bind
from burst.launch import end_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--sample", action="store_true", help="top-p sampling (seeded alike on every rank)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU per rank (cuda:LOCAL_RANK) and NCCL; cpu: gloo",
    )
    args = parser.parse_args()
    device = bind(args.device)  # cuda:LOCAL_RANK made current before NCCL starts, or the CPU
    dist.init_process_group(backend_for(args.device), device_id=device if device.type == "cuda" else None)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        max_position_embeddings=args.prompt_len + args.new_tokens,
    )
    torch.manual_seed(0)  # the same weights on every rank
    name = bt.register(layout=args.layout)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name).to(device).eval()
    prompts = torch.randint(1, config.vocab_size, (2, args.prompt_len), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    torch.manual_seed(2)  # sampling draws from the global generator: seeded alike, every rank draws the same
    out = model.generate(
        prompts,
        **bt.sharded_cache(model),
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=args.sample,
        top_p=0.9,
    )
    if dist.get_rank() == 0:
        for row in out[:, args.prompt_len :].tolist():
            print("tokens", *row, flush=True)
    end_rank()  # past every peer's last collective, then no interpreter finalization (gloo can abort there)


if __name__ == "__main__":
    main()
