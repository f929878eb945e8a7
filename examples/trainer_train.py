"""Long-context training with the transformers Trainer, each sequence split over ranks by burst.

    torchrun --nproc-per-node 2 examples/trainer_train.py                  # 2 ranks on one sequence
    torchrun --nproc-per-node 4 examples/trainer_train.py --sp-size 2 --eval-rows 4   # 2 replicas x 2 ranks
    python examples/trainer_train.py --reference --batch 4 --eval-rows 4              # one process, eager
    torchrun --nproc-per-node 1 examples/trainer_train.py --device cuda --bf16 --fsdp   # a GPU, FSDP2

A tiny Llama (random weights from a config, no download) trains on random token rows of uneven
lengths, right-padded by the collator (--packed: packed into one row per batch), with gradient
accumulation and clipping; then evaluate() and predict(). Rank 0 prints each step's loss; --out DIR
saves what the tests compare (each step's loss and gradients, the final weights, eval loss,
predictions). --reference runs the plain Trainer in one process: give it --batch = replicas x the
per-rank batch to see the same global batches, and eval rows that the replicas split evenly (--eval-rows 4
at 2 replicas: otherwise one pads its last batch, as plain DDP's does, and the eval losses differ).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

from burst.devices import bind
from burst.launch import end_rank

VOCAB = 96


class RandomRows(torch.utils.data.Dataset):
    """`count` rows of random tokens, lengths between `shortest` and `longest` (a fixed seed)."""

    def __init__(self, count: int, shortest: int, longest: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(shortest, longest + 1, (count,), generator=g)
        self.rows = [torch.randint(0, VOCAB, (int(n),), generator=g) for n in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def pad_right(rows: list[dict]) -> dict:
    """A causal-LM batch: rows padded on the right, labels -100 and attention_mask 0 on padding."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = row["input_ids"], row["input_ids"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack(rows: list[dict]) -> dict:
    """The rows packed into one (transformers' DataCollatorWithFlattening): position ids restart at
    0 for each document, whose first label is -100; no padding, no attention_mask."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": r["input_ids"].tolist()} for r in rows])


class RecordGradients(TrainerCallback):
    """Each optimizer step's gradients (whole tensors, FSDP's shards gathered), kept on the host."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append(
            {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    parser.add_argument("--layout", default="zigzag", help="how each sequence is cut across its ranks")
    parser.add_argument("--strategy", default="burst", help="burst.attention strategy")
    parser.add_argument("--batch", type=int, default=2, help="rows per rank (per replica) and step")
    parser.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=96, help="longest row; rows are 1/2 to 1 of it")
    parser.add_argument("--eval-rows", type=int, default=5, help="rows of the eval and predict sets (2 a batch)")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    parser.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim")
    parser.add_argument("--family", default="llama", help="model_type to build tiny (e.g. qwen3_next, mamba)")
    parser.add_argument("--packed", action="store_true", help="pack each batch's rows into one (no padding)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    parser.add_argument("--reference", action="store_true", help="plain Trainer, eager attention, one process")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank")
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments.bf16 (autocast; float32 weights)")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 through the Trainer's own accelerate plugin (fsdp=True, fsdp_config version 2)",
    )
    parser.add_argument(
        "--fused-loss", action="store_true", help="the training loss from the hidden states, never the logits"
    )
    parser.add_argument(
        "--router-loss",
        type=float,
        default=None,
        metavar="COEF",
        help="MoE families: add the routers' load-balancing loss (output_router_logits) with this coefficient",
    )
    parser.add_argument("--out", default=None, help="save losses, gradients, weights, eval and predictions here")
    args = parser.parse_args()
    if args.fsdp and args.device == "cpu":  # accelerate would run DDP instead, and say so only by the wrapper
        raise SystemExit("--fsdp: accelerate applies FSDP on GPUs only (on the CPU it runs DDP); add --device cuda")
    bind(args.device)  # a clear error where --device cuda finds no GPU for this rank
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # torchrun's stop: the scratch goes

    if args.family == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4 * args.seq_len,
        )
    else:  # any causal-LM family, built tiny from its own config class (as the zoo builds it)
        from burst.bench.hf_zoo import tiny_config

        config = tiny_config(args.family)
    if args.router_loss is not None:
        config.output_router_logits, config.router_aux_loss_coef = True, args.router_loss
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # the Trainer makes its output_dir even with save_strategy="no": without --out, a folder that goes at exit
    scratch = None if args.out else tempfile.TemporaryDirectory(prefix="burst-trainer-")
    training = TrainingArguments(
        output_dir=args.out or scratch.name,
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=args.accumulate,
        max_steps=args.steps,
        optim=args.optim,
        learning_rate=args.lr,
        max_grad_norm=0.5,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=args.device == "cpu",
        seed=3,
        gradient_checkpointing=args.checkpointing,
        bf16=args.bf16,
        **(dict(fsdp=True, fsdp_config={"version": 2}) if args.fsdp else {}),
        dataloader_drop_last=False,
        disable_tqdm=True,
        include_num_input_tokens_seen="all",
    )
    recorder = RecordGradients()  # a copy of every gradient each step: only when they are saved
    common = dict(
        model=model,
        args=training,
        data_collator=pack if args.packed else pad_right,
        callbacks=[recorder] if args.out else [],
        train_dataset=RandomRows(64, args.seq_len // 2, args.seq_len, seed=1),
        eval_dataset=RandomRows(args.eval_rows, args.seq_len // 2, args.seq_len, seed=2),
    )
    if args.reference:
        trainer = Trainer(**common)
    else:
        from burst.integrations.transformers import SequenceParallelTrainer

        trainer = SequenceParallelTrainer(
            **common, sp_size=args.sp_size, strategy=args.strategy, layout=args.layout, fused_loss=args.fused_loss
        )
    trainer.train()
    sharded = any(hasattr(p, "full_tensor") for p in trainer.model.parameters())  # FSDP2 holds DTensors
    if args.fsdp and not sharded:  # accelerate runs DDP instead where it cannot apply FSDP (on the CPU)
        raise SystemExit(
            f"--fsdp: accelerate did not shard the model (wrapped as {type(trainer.model_wrapped).__name__})"
        )
    metrics = trainer.evaluate()
    predictions = trainer.predict(RandomRows(args.eval_rows, args.seq_len // 2, args.seq_len, seed=4))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if trainer.is_world_process_zero():
        for step, loss in enumerate(losses):
            print(f"step {step} loss {loss:.6f}", flush=True)
        print(f"eval loss {metrics['eval_loss']:.6f}", flush=True)
    weights = (
        {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # FSDP: a collective
            for n, p in trainer.model.named_parameters()
        }
        if args.out
        else None
    )
    if args.out and trainer.is_world_process_zero():
        os.makedirs(args.out, exist_ok=True)
        torch.save(
            {
                "losses": losses,
                "grads": recorder.steps,
                "weights": weights,
                "eval_loss": metrics["eval_loss"],
                "predictions": predictions.predictions,
                "label_ids": predictions.label_ids,
                "predict_loss": predictions.metrics["test_loss"],
                "sharded": sharded,
                "tokens_seen": trainer.state.num_input_tokens_seen,
            },
            os.path.join(args.out, "result.pt"),
        )
    if scratch is not None:
        scratch.cleanup()  # end_rank skips the interpreter's finalizers, which would remove it
    if torch.distributed.is_initialized():
        end_rank()  # past every peer's last collective, then no interpreter finalization (gloo can abort there)


if __name__ == "__main__":
    main()
