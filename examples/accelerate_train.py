"""A hand-written accelerate training loop, each sequence split over ranks by burst.

    torchrun --nproc-per-node 2 examples/accelerate_train.py                  # 2 ranks on one sequence
    torchrun --nproc-per-node 4 examples/accelerate_train.py --sp-size 2      # 2 replicas x 2 ranks
    python examples/accelerate_train.py --reference --batch 4                 # one process, eager attention
    torchrun --nproc-per-node 8 examples/accelerate_train.py --device cuda    # 8 GPUs (docs/launch.md)

The tiny Llama and random right-padded rows of examples/trainer_train.py, trained by a plain loop:
`accelerator.prepare`, then burst's `SequenceParallel`
(burst/integrations/transformers/sequence_parallel.py) re-points the loader at the replicas and
turns each batch into this rank's shard and loss; gradient accumulation and clipping are
accelerate's. Rank 0 prints each step's loss; --out DIR saves each
step's loss and gradients and the final weights (what the tests compare with --reference).
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, LlamaConfig

from burst.devices import bind
from burst.launch import end_rank
from trainer_train import VOCAB, RandomRows, pad_right


def main() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    parser.add_argument("--layout", default="zigzag", help="how each sequence is cut across its ranks")
    parser.add_argument("--batch", type=int, default=2, help="rows per replica and micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=96, help="longest row; rows are 1/2 to 1 of it")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--reference", action="store_true", help="plain loop, eager attention, one process")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU per rank (accelerate binds cuda:LOCAL_RANK, NCCL)",
    )
    parser.add_argument("--out", default=None, help="save losses, gradients and weights here")
    args = parser.parse_args()

    bind(args.device)  # a clear error where --device cuda finds no GPU for this rank
    accelerator = Accelerator(cpu=args.device == "cpu", gradient_accumulation_steps=args.accumulate)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * args.seq_len,
    )
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    rows = RandomRows(64, args.seq_len // 2, args.seq_len, seed=1)
    loader = torch.utils.data.DataLoader(rows, batch_size=args.batch, collate_fn=pad_right)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sp = None
    if not args.reference:
        from burst.integrations.transformers import SequenceParallel

        sp = SequenceParallel(model, sp_size=args.sp_size, layout=args.layout)
        loader = sp.dataloader(loader)

    losses, grads, micro = [], [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = sp.loss(model, batch) if sp else model(**batch).loss
            accelerator.backward(loss)
            micro.append(float(sp.mean_loss(loss)) if sp else float(loss))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
                grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
                losses.append(sum(micro) / len(micro))
                micro = []
            optimizer.step()
            optimizer.zero_grad()
        if len(losses) == args.steps:
            break
    if accelerator.is_main_process:
        for step, loss in enumerate(losses):
            print(f"step {step} loss {loss:.6f}", flush=True)
    if args.out and accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        weights = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
        torch.save(
            {
                "losses": losses,
                "grads": [{n.removeprefix("module."): g for n, g in step.items()} for step in grads],
                "weights": weights,
            },
            os.path.join(args.out, "result.pt"),
        )
    if torch.distributed.is_initialized():
        end_rank()  # past every peer's last collective, then no interpreter finalization (gloo can abort there)


if __name__ == "__main__":
    main()
