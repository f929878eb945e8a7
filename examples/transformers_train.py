"""A transformers Llama (random weights from a config) trained sequence-parallel through burst.

    torchrun --nproc-per-node 2 examples/transformers_train.py [--steps 2] [--seq-len 256]

Every rank holds 1/G of each sequence; rank 0 prints the global loss of each step, which equals what
one process training the same model on the whole sequence prints (`--nproc-per-node 1`).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import burst.integrations.transformers as bt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--strategy", default="burst")
    parser.add_argument("--layout", default="zigzag")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)  # the same weights on every rank
    name = bt.register(strategy=args.strategy, layout=args.layout)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)  # the same batch on every rank; each keeps its shard
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=data)
        out = model(**bt.shard_batch({"input_ids": ids, "labels": ids}, layout=args.layout))
        out.loss.backward()
        bt.reduce_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
        loss = bt.reduce_loss(out.loss)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
