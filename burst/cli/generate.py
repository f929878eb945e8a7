"""`burst generate`: generation on a sharded KV cache (prefill through burst, exact decode)."""

from __future__ import annotations

from ..layout import LAYOUTS
from .common import (
    BadOption,
    add_common,
    add_device_options,
    any_case,
    blame,
    check_readable_file,
    check_writable_file,
    nonnegative_float,
    nonnegative_int,
    note,
    positive_int,
    probability,
    progress,
    publish,
    resolve_checked_device,
    world_size,
)


def add_parser(sub) -> None:
    from ..api import STRATEGY_NAMES
    from ..engine.model import PRESETS

    p = sub.add_parser(
        "generate",
        help="generate on a sharded KV cache (prefill through burst, exact decode)",
        description="Generate tokens after a prompt with the KV cache split over the ranks; "
        "prints the new token ids and their text (byte-level tokens).",
    )
    p.add_argument(
        "--model",
        type=any_case(sorted(PRESETS)),
        default=None,
        help=f"model preset ({', '.join(sorted(PRESETS))}); default: the checkpoint's, else tiny",
    )
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="load the weights `burst train` wrote there")
    p.add_argument(
        "--checkpoint-step", type=positive_int, default=None, help="which step's checkpoint; default: the latest"
    )
    p.add_argument(
        "--prompt-len", type=positive_int, default=None, help="tokens of the random prompt (seeded); default 256"
    )
    p.add_argument(
        "--prompt-file",
        default=None,
        metavar="PATH",
        help="a text file as the prompt (byte-level tokens) instead of a random one",
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="random prompts, of lengths prompt-len, prompt-len - 1, ...; default 1",
    )
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens to generate after each prompt")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seeds the prompt, the weights and sampling")
    p.add_argument(
        "--strategy",
        type=any_case(STRATEGY_NAMES),
        default="burst",
        help=f"attention strategy of the prefill: {', '.join(STRATEGY_NAMES)}",
    )
    p.add_argument(
        "--layout",
        type=any_case(LAYOUTS),
        default="contiguous",
        help=f"how the prompt is split over the ranks: {', '.join(LAYOUTS)}",
    )
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument(
        "--top-p",
        type=probability,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose probability reaches this, in (0, 1]",
    )
    add_device_options(p)
    add_common(p, default_nproc=2)


def validate(args) -> None:
    """Resolves the model and the prompts (args.model_name, args.prompts) for run()."""
    from ..engine.model import PRESETS
    from ..inference.generate import check_request
    from ..plan.takes import check_call

    check_writable_file("--json", args.json)
    if args.top_p != 1.0 and args.temperature == 0:
        raise BadOption("--top-p", "samples among the likeliest tokens: give --temperature above 0 (0 is greedy)")
    args.device = resolve_checked_device(args)
    args.model_name = _model_name(args)
    args.prompts = _prompts(args)
    preset = PRESETS[args.model_name]
    with blame("--new-tokens"):
        check_request(args.prompts, args.new_tokens, preset.max_seq_len)
    too_big = max(t for p in args.prompts for t in p)
    if too_big >= preset.vocab_size:
        raise BadOption(
            "--prompt-file",
            f"holds token {too_big}, beyond model {args.model_name!r}'s vocabulary of {preset.vocab_size}",
        )
    world = world_size(args)
    padded = _padded_length(max(len(p) for p in args.prompts), world, args.layout)
    with blame("--strategy"):
        check_call(
            world,
            padded,
            preset.heads,
            preset.kv_heads,
            preset.head_dim,
            strategy=args.strategy,
            layout=args.layout,
            batch=len(args.prompts),
            causal=True,
        )


def _padded_length(longest: int, world: int, layout: str) -> int:
    """The prompt length the prefill runs (inference/generate.py pads to what the layout splits)."""
    from ..layout import local_multiple

    multiple = world * local_multiple(layout)
    return -(-longest // multiple) * multiple


def _model_name(args) -> str:
    """--model, or the checkpoint's (which must agree with --model when both are given)."""
    if not args.checkpoint_dir:
        if args.checkpoint_step is not None:
            raise BadOption("--checkpoint-step", "needs --checkpoint-dir (where the checkpoints are)")
        return args.model or "tiny"
    from ..engine.resume import checkpoint_model_name, latest_step

    with blame("--checkpoint-dir"):
        step = args.checkpoint_step if args.checkpoint_step is not None else latest_step(args.checkpoint_dir)
    with blame("--checkpoint-step"):
        trained = checkpoint_model_name(args.checkpoint_dir, step)
    if args.model and args.model != trained:
        raise BadOption(
            "--model",
            f"the checkpoint holds model {trained!r}, not {args.model!r} (leave --model out to use the checkpoint's)",
        )
    args.checkpoint_step = step
    return trained


def _prompts(args) -> list[list[int]]:
    if args.prompt_file:
        check_readable_file("--prompt-file", args.prompt_file)
        with open(args.prompt_file, "rb") as f:
            prompt = list(f.read())
        if not prompt:
            raise BadOption("--prompt-file", f"{args.prompt_file!r} is empty (a prompt needs at least one token)")
        for option, value in (("--prompt-len", args.prompt_len), ("--batch", args.batch)):
            if value is not None:
                raise BadOption(
                    option, "shapes the random prompts: give it without --prompt-file (one prompt, the file)"
                )
        return [prompt]
    import torch

    g = torch.Generator().manual_seed(args.seed)
    length, batch = args.prompt_len or 256, args.batch or 1
    return [torch.randint(0, 256, (max(1, length - i),), generator=g).tolist() for i in range(batch)]


def run(args) -> int:
    from ..devices import backend_for
    from ..launch import run_world

    lengths = sorted({len(p) for p in args.prompts})
    note(
        "burst generate",
        f"{len(args.prompts)} prompt(s) of {'-'.join(map(str, lengths))} tokens, "
        f"{args.new_tokens} new tokens each, on {world_size(args)} rank(s)",
    )
    kwargs = dict(
        model=args.model_name,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_step=args.checkpoint_step,
        prompts=args.prompts,
        new_tokens=args.new_tokens,
        strategy=args.strategy,
        layout=args.layout,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
    )
    result = run_world(_generate_on_rank, kwargs, nproc=args.nproc, backend=backend_for(args.device))
    result["text"] = [decode_bytes(row) for row in result["tokens"]]
    publish(args, result, summary(result))
    return 0


def decode_bytes(tokens: list[int]) -> str:
    """Byte-level tokens as text (an id of 256 or more, not a byte, as U+FFFD)."""
    return b"".join(bytes([t]) if t < 256 else "\ufffd".encode() for t in tokens).decode("utf-8", errors="replace")


def summary(result: dict) -> str:
    lines = [
        f"prefill {result['prefill_s']:.3f} s (time to first token), decode "
        f"{result['decode_s_per_token'] * 1e3:.1f} ms/token ({1 / max(result['decode_s_per_token'], 1e-9):.1f} "
        f"tokens/s), KV cache {result['cache_bytes_per_rank'] / 2**20:.2f} MiB per rank"
    ]
    for i, (row, text) in enumerate(zip(result["tokens"], result["text"])):
        lines.append(f"[{i}] ids:  {' '.join(map(str, row))}")
        lines.append(f"[{i}] text: {text!r}")
    return "\n".join(lines)


def _generate_on_rank(rank, world, kwargs):
    import torch

    from ..devices import bind, parse_dtype
    from ..engine.model import PRESETS, Transformer
    from ..inference.generate import generate

    torch.manual_seed(kwargs["seed"])  # the same (random) weights on every rank unless a checkpoint is loaded
    model = Transformer(PRESETS[kwargs["model"]]).eval()
    if kwargs["checkpoint_dir"]:
        from ..engine.resume import load_model_weights

        load_model_weights(kwargs["checkpoint_dir"], kwargs["checkpoint_step"], model)
    model.to(bind(kwargs["device"]), parse_dtype(kwargs["dtype"]))  # the launcher bound the rank's GPU already
    step = _token_progress(model, kwargs["new_tokens"])
    result = generate(
        model,
        kwargs["prompts"],
        kwargs["new_tokens"],
        strategy=kwargs["strategy"],
        layout=kwargs["layout"],
        temperature=kwargs["temperature"],
        top_p=kwargs["top_p"],
        seed=kwargs["seed"],
    )
    step.close()
    return result.__dict__


def _token_progress(model, new_tokens: int):
    """Progress by generated token: the LM head runs once per token (the prefill's first, then
    each decode step's), so a forward hook on it counts them."""
    step = progress(new_tokens, "burst generate", "token", lines=10)
    count = [0]

    def on_token(*_):
        count[0] += 1
        step("prefill (first token)" if count[0] == 1 else "decode")

    model.lm_head.register_forward_hook(on_token)
    return step
