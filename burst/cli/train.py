"""`burst train`: the LLaMA-style model, sequence-parallel, on a local world or torchrun's."""

from __future__ import annotations

import os
import sys

from ..layout import LAYOUTS
from .common import (
    BadOption,
    add_common,
    add_device_options,
    any_case,
    blame,
    check_readable_file,
    check_writable_dir,
    check_writable_file,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    publish,
    resolve_checked_device,
    world_size,
)


def add_parser(sub) -> None:
    from ..api import STRATEGY_NAMES
    from ..engine.model import PRESETS
    from ..engine.train import TRAIN_DTYPES, TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train the LLaMA-style model sequence-parallel (a local world or torchrun's)",
        description="Train the engine's LLaMA-style model with attention split over the ranks; "
        "one JSON line per step with --metrics, checkpoints with --checkpoint-dir.",
    )
    p.add_argument(
        "--model", type=any_case(sorted(PRESETS)), default=d.model, help=f"model preset: {', '.join(sorted(PRESETS))}"
    )
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=d.seq_len,
        help="global tokens per sequence (a multiple of the sequence-parallel ranks; x2 for zigzag)",
    )
    p.add_argument("--batch", type=positive_int, default=d.batch, help="sequences per data-parallel replica per step")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimizer steps in all (a resumed run too)")
    p.add_argument("--seed", type=nonnegative_int, default=d.seed, help="seeds the weights and the data")
    p.add_argument(
        "--data",
        default=d.data,
        help="'synthetic', a token file (.bin: uint16, .u32.bin: uint32) or a text file (bytes)",
    )
    p.add_argument(
        "--strategy",
        type=any_case(STRATEGY_NAMES),
        default=d.strategy,
        help=f"attention strategy: {', '.join(STRATEGY_NAMES)}",
    )
    p.add_argument(
        "--layout",
        type=any_case(LAYOUTS),
        default=d.layout,
        help=f"how each sequence is split over the ranks: {', '.join(LAYOUTS)}",
    )
    p.add_argument("--lr", type=positive_float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument(
        "--warmup", type=nonnegative_int, default=d.warmup, help="steps of linear warm-up before the cosine decay"
    )
    p.add_argument(
        "--peak-flops",
        type=nonnegative_float,
        default=d.peak_flops,
        help="per-device peak FLOP/s for MFU; 0 = unknown (mfu n/a)",
    )
    p.add_argument("--metrics", default=None, metavar="PATH", help="write one JSON object per step to this file")
    p.add_argument(
        "--dp", type=positive_int, default=d.dp, help="data-parallel replicas (sequence-parallel ranks = world / dp)"
    )
    p.add_argument(
        "--fsdp",
        type=any_case(("none", "dp", "mesh")),
        default=d.fsdp,
        help="FSDP2 parameter sharding: none, over the dp dimension, or over every rank (mesh)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="FSDP2 CPU offload of parameters, gradients and optimizer state (with --fsdp; several ranks)",
    )
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="one rank: AdamW's fp32 master weights and moments in host memory, each parameter stepped "
        "there as its gradient completes; the device keeps the weights in --dtype (16 GB for an 8B "
        "model in bfloat16) and one layer's gradients",
    )
    p.add_argument(
        "--offload-activations",
        action="store_true",
        help="keep what --checkpointing keeps per layer (its input; remat's attention output) in pinned "
        "host memory between forward and backward",
    )
    p.add_argument(
        "--offload-layers",
        type=int,
        default=d.offload_layers,
        metavar="N",
        help="with --offload-activations: the first N layers' only, the rest on the device (0: every "
        "layer; `burst plan --longest` names the N that fits the longest step)",
    )
    p.add_argument(
        "--checkpointing",
        type=any_case(("none", "full", "remat", "selective")),
        default=d.checkpointing,
        help="activation checkpointing: none, full (per layer), remat (DistFlashAttn's, at the "
        "attention output), selective (BurstEngine's sequence-level)",
    )
    p.add_argument(
        "--checkpoint-split",
        type=float,
        default=None,
        help=f"selective: the fraction of the sequence whose attention is recomputed, in [0, 1] "
        f"(default {d.checkpoint_split})",
    )
    p.add_argument(
        "--ffn-chunk",
        type=nonnegative_int,
        default=d.ffn_chunk,
        help="blockwise feedforward: tokens per chunk, each checkpointed, so the backward holds one "
        "chunk's hidden activations (0 = off)",
    )
    p.add_argument(
        "--no-fused-loss",
        dest="fused_loss",
        action="store_false",
        help="build the logits (the baseline of the fused LM head + loss, which holds one chunk of them)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="a line per step instead of a bar")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="where checkpoints are written and read (torch.distributed.checkpoint)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=nonnegative_int,
        default=0,
        help="write a checkpoint every K steps (0 = never; needs --checkpoint-dir)",
    )
    p.add_argument(
        "--resume-step", type=positive_int, default=None, help="resume from the checkpoint written after K steps"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="resume from the latest complete checkpoint in --checkpoint-dir, or start fresh when it "
        "holds none (what to repeat after a failure, e.g. under torchrun --max-restarts)",
    )
    p.add_argument(
        "--keep",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="keep the N newest checkpoints, deleting older ones once a new one is complete (0 = all)",
    )
    add_device_options(p, dtypes=TRAIN_DTYPES, default_dtype=d.dtype)
    add_common(p)


def config(args):
    from dataclasses import fields

    from ..engine.train import TrainConfig

    keys = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in keys}
    if values.get("checkpoint_split", 0) is None:  # not given: TrainConfig's default
        del values["checkpoint_split"]
    elif values.get("checkpointing") != "selective" and "checkpoint_split" in values:  # given, even as the default
        from ..engine.train_config import SPLIT_WITHOUT_SELECTIVE

        raise ValueError(SPLIT_WITHOUT_SELECTIVE)
    if getattr(args, "resume", False):
        from ..engine.resume import resume_point

        values["resume_step"] = resume_point(args.checkpoint_dir)
    return TrainConfig(**values)


def validate(args) -> None:
    if args.json is not None:
        check_writable_file("--json", args.json)
    if args.metrics is not None:
        check_writable_file("--metrics", args.metrics)
    if args.data != "synthetic":
        check_readable_file("--data", args.data)
    if args.resume and args.resume_step is not None:
        raise BadOption("--resume", "takes the latest checkpoint; give it or --resume-step K, not both")
    if args.resume and args.checkpoint_dir is None:
        raise BadOption("--resume", "needs --checkpoint-dir (where the checkpoints are, or will be)")
    if args.checkpoint_dir is not None:
        if args.resume_step is not None and not os.path.isdir(args.checkpoint_dir):
            raise BadOption("--checkpoint-dir", f"{args.checkpoint_dir!r} is not a directory (nothing to resume)")
        check_writable_dir("--checkpoint-dir", args.checkpoint_dir)
    try:
        with blame("--nproc"):  # each of TrainConfig's errors names its own option
            config(args).check(world_size(args))
    except BadOption as bad:  # --resume picks the step itself: its checks are --resume's
        if args.resume and bad.option == "--resume-step":
            raise BadOption("--resume", bad.problem) from bad
        raise
    args.device = resolve_checked_device(args)  # cpu or cuda from here on; --kernel checked and set for the ranks


def run(args) -> int:
    from dataclasses import asdict

    from ..devices import backend_for
    from ..launch import run_world

    cfg = config(args)
    if cfg.resume_step is not None and cfg.resume_step == cfg.steps:
        print(
            f"burst train: nothing left to train: the checkpoint after step {cfg.resume_step} in "
            f"{cfg.checkpoint_dir} is the last of --steps {cfg.steps}",
            file=sys.stderr,
        )
        publish(args, [])  # --json still gets its document: no step ran
        return 0
    rows = run_world(_train_on_rank, asdict(cfg), nproc=args.nproc, backend=backend_for(cfg.device))
    publish(args, rows)
    return 0


def _train_on_rank(rank, world, cfg_dict):
    from ..engine.train import TrainConfig, train

    return train(rank, world, TrainConfig(**cfg_dict))
