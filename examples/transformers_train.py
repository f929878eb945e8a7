r"""Long-context fine-tuning of a transformers Llama (random weights from a config) through burst.

    torchrun --nproc-per-node 2 examples/transformers_train.py [--steps 2] [--seq-len 256]
    torchrun --nproc-per-node 4 examples/transformers_train.py --bf16 --checkpointing --fsdp   # the long-context recipe
    torchrun --nproc-per-node 8 examples/transformers_train.py --device cuda --bf16 --checkpointing --fsdp \
        --seq-len 65536

Every rank holds 1/G of each sequence; rank 0 prints the global loss of each step, which equals what
one process training the same model on the whole sequence prints (`--nproc-per-node 1`), to float
rounding (bf16 rounding with --bf16). The recipe's parts, each optional:
  --bf16           torch.autocast(bfloat16): attention runs, and its ring carries, bf16
  --checkpointing  transformers' gradient checkpointing (each layer, burst's ring included, re-run)
  --fsdp           FSDP2 over the sequence-parallel ranks (bt.fully_shard: per decoder layer + root)
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import burst.integrations.transformers as bt
from burst.devices import backend_for, bind
from burst.launch import end_rank


def main() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (global)")
    parser.add_argument("--strategy", default="burst", help="burst.attention strategy")
    parser.add_argument("--layout", default="zigzag", help="how the sequence is cut across ranks")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over the ranks (bt.fully_shard)")
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
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(0)  # the same weights on every rank
    name = bt.register(strategy=args.strategy, layout=args.layout)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name).to(device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    if args.fsdp:
        bt.fully_shard(model)  # gradients come out of FSDP's reduce-scatter as one process's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = torch.autocast(device.type, torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    data = torch.Generator().manual_seed(1)  # the same batch on every rank; each keeps its shard
    model.train()
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=data).to(device)
        with autocast:
            out = model(**bt.shard_batch({"input_ids": ids, "labels": ids}, layout=args.layout, model=model))
        out.loss.backward()
        bt.reduce_gradients(model)  # sums the ranks' shares (FSDP-managed parameters: only what FSDP left)
        optimizer.step()
        optimizer.zero_grad()
        loss = bt.reduce_loss(out.loss)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.barrier()  # no rank closes its connections while a peer still finishes a collective
    end_rank()  # past every peer's last collective, then no interpreter finalization (gloo can abort there)


if __name__ == "__main__":
    main()
