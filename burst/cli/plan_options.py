"""`burst plan`'s options: their definitions (add_parser) and their checks (validate), which read a
--hf-config's shapes into them and resolve the model (model_of) before anything is planned."""

from __future__ import annotations

import os

from ..layout import LAYOUTS
from .common import BadOption, add_common, any_case, blame, check_writable_file, positive_float, positive_int

DEFAULT_LAYOUT = "zigzag"
DEFAULT_GPUS_PER_NODE = 8


def add_parser(sub) -> None:
    from ..plan import PROFILES, model_presets
    from ..plan.model_cost import CHECKPOINTING, MODES
    from ..plan.models import PRESETS

    p = sub.add_parser(
        "plan",
        help="estimate each strategy's time, traffic and memory on a described cluster",
        description="Model forward + backward of attention for every strategy on a described "
        "cluster; strategies that fit come first, fastest first.",
    )
    p.add_argument("--gpus", type=positive_int, required=True, help="devices in the cluster")
    p.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=None,
        help=f"devices per node (the whole cluster when larger than --gpus; default {DEFAULT_GPUS_PER_NODE})",
    )
    p.add_argument(
        "--profile",
        type=any_case(sorted(PROFILES)),
        default="H100",
        help=f"hardware profile, any case: {', '.join(sorted(PROFILES))} ('local' = this machine, "
        "calibrated by `burst bench --calibrate`)",
    )
    p.add_argument(
        "--seq-len", type=positive_int, default=None, help="global sequence length (tokens); required unless --longest"
    )
    p.add_argument(
        "--longest",
        action="store_true",
        help="with --model: for each of `burst train`'s memory options (checkpointing, --ffn-chunk, host "
        "offloads), the longest --seq-len whose step fits and the modelled speed and MFU there",
    )
    p.add_argument(
        "--host-mem-gib",
        type=positive_float,
        default=None,
        help="host memory in GiB that decides fits with host offloads; default: not limited",
    )
    p.add_argument(
        "--model",
        type=any_case(sorted(model_presets())),
        default=None,
        help="plan the whole model (FFN, projections, LM head, FSDP, optimizer): a preset, any case: "
        + ", ".join(sorted(model_presets()))
        + " (`burst train` trains "
        + ", ".join(sorted(PRESETS))
        + "; the others are the papers' models, to plan only); the shape flags below override its fields",
    )
    p.add_argument(
        "--hidden",
        type=positive_int,
        default=None,
        help="whole model without a preset: hidden size (with --ffn-hidden, --vocab, --heads, --layers)",
    )
    p.add_argument("--ffn-hidden", type=positive_int, default=None, help="SwiGLU hidden size (whole model)")
    p.add_argument("--vocab", type=positive_int, default=None, help="vocabulary size (whole model)")
    p.add_argument("--heads", type=positive_int, default=None, help="query heads (required without --model)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (GQA); default: --heads")
    p.add_argument(
        "--head-dim",
        type=positive_int,
        default=None,
        help="dimension of each head (required for attention alone; whole model: --hidden / --heads)",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per step (per data-parallel replica)")
    p.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="layers (time and memory scale by it); default: the model's, else 1",
    )
    p.add_argument("--attention-only", action="store_true", help="with --model: plan its attention alone")
    p.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="a transformers model's config (config.json, its folder or a hub id): plan its attention "
        "layers, with the indexer keys and compressed entries of DeepSeek's sparse attention "
        "(needs transformers: pip install 'transformers>=5.23.0,<6', or '.[hf]' from a burst clone)",
    )
    p.add_argument(
        "--mode",
        type=any_case(MODES),
        default="train",
        help="train (forward + backward, and the optimizer for a whole model) or prefill (one forward)",
    )
    p.add_argument(
        "--checkpointing",
        type=any_case(CHECKPOINTING),
        default="none",
        help="whole model: activation checkpointing, as `burst train`'s (same default): " + ", ".join(CHECKPOINTING),
    )
    p.add_argument(
        "--dp",
        type=positive_int,
        default=1,
        help="whole model: data-parallel replicas; each runs the sequence over --gpus / --dp devices",
    )
    p.add_argument("--unfused-loss", action="store_true", help="whole model: LM head builds the full logits")
    p.add_argument("--no-fsdp", action="store_true", help="whole model: weights and optimizer state replicated")
    p.add_argument("--offload-optimizer", action="store_true", help="whole model: Adam state and step on the host")
    p.add_argument(
        "--no-backward-overlap",
        action="store_true",
        help="whole model: ring transfers of the backward wait for compute (LoongTrain's double ring)",
    )
    p.add_argument(
        "--gpu-mem-gib",
        type=positive_float,
        default=None,
        help="device memory in GiB that decides fits; default: the profile's",
    )
    p.add_argument("--causal", action="store_true", help="causal mask (default: full attention)")
    p.add_argument(
        "--window",
        type=positive_int,
        default=None,
        help="causal sliding window: the keys each query sees at most (with --causal; attention alone)",
    )
    p.add_argument(
        "--layout",
        type=any_case(LAYOUTS),
        default=None,
        help=f"how the sequence is split: {', '.join(LAYOUTS)} (default {DEFAULT_LAYOUT})",
    )
    p.add_argument(
        "--dtype-bytes",
        type=int,
        choices=(1, 2, 4, 8),
        default=None,
        help="bytes per element of q, k, v; default: the profile's (2 on GPUs)",
    )
    p.add_argument(
        "--inter-node-gbps",
        type=positive_float,
        default=None,
        help="inter-node GB/s per device per direction; default: the profile's",
    )
    p.add_argument(
        "--intra-node-gbps",
        type=positive_float,
        default=None,
        help="intra-node GB/s per device per direction; default: the profile's",
    )
    add_common(p, world=False)
    # what --hf-config reads of a model beyond its shapes (_apply_hf_config): nothing without one
    p.set_defaults(gathered=(0.0, 0.0), entries=0.0, indexer_macs=0.0, windowed_share=1.0, latent=None)


def validate(args) -> None:
    if args.longest:
        _check_longest_first(args)
    args.layout = args.layout or DEFAULT_LAYOUT  # None: not given (--longest refuses what it would not read)
    args.gpus_per_node = args.gpus_per_node or DEFAULT_GPUS_PER_NODE
    if args.longest and args.model is None:
        raise BadOption("--longest", "needs --model (the model whose longest training step is planned)")
    if args.longest and args.seq_len is not None:
        raise BadOption("--longest", "finds the length: give it without --seq-len")
    if args.seq_len is None and not args.longest:
        raise BadOption("--seq-len", "required (or --longest with --model)")
    if args.longest:
        args.seq_len = 1024  # the shape checks below read one
    if args.hf_config is not None:
        _apply_hf_config(args)
    whole = args.model is not None or args.hidden is not None
    if args.model is None and args.attention_only:
        raise BadOption("--attention-only", "needs --model (without one, attention alone is planned)")
    for option in ("ffn_hidden", "vocab"):
        if args.attention_only and getattr(args, option) is not None:
            raise BadOption(
                f"--{option.replace('_', '-')}", "describes the whole model: --attention-only plans its attention"
            )
    if args.inter_node_gbps is not None and args.gpus <= args.gpus_per_node:
        raise BadOption("--inter-node-gbps", f"{args.gpus} GPU(s) are one node (--gpus-per-node {args.gpus_per_node})")
    if args.hidden is not None and args.model is None:
        for option in ("ffn_hidden", "vocab", "heads", "layers"):
            if getattr(args, option) is None:
                raise BadOption(f"--{option.replace('_', '-')}", "required with --hidden (or give --model)")
    if not whole:
        for option in ("heads", "head_dim"):
            if getattr(args, option) is None:
                raise BadOption(f"--{option.replace('_', '-')}", "required without --model or --hidden")
        for option in ("ffn_hidden", "vocab"):
            if getattr(args, option) is not None:
                raise BadOption(f"--{option.replace('_', '-')}", "describes a whole model: give --hidden or --model")
    if whole:
        cfg = model_of(args)
        if args.head_dim is not None and args.head_dim * cfg.heads != cfg.dim:
            raise BadOption("--head-dim", f"{args.head_dim} x {cfg.heads} heads is not the hidden size {cfg.dim}")
        if cfg.dim % cfg.heads:
            raise BadOption("--heads", f"{cfg.heads} does not divide the hidden size {cfg.dim}")
        if args.kv_heads is None and cfg.heads % cfg.kv_heads:
            raise BadOption("--heads", f"{cfg.heads} is not a multiple of the model's {cfg.kv_heads} KV heads")
    if args.window is not None and not args.causal:
        raise BadOption("--window", "is a causal sliding window: give --causal")
    if args.window is not None and whole and not args.attention_only:
        raise BadOption("--window", "plans attention alone: give --attention-only with --model, or no --model")
    if args.dp > 1 and (not whole or args.attention_only):
        raise BadOption("--dp", "needs --model or --hidden (attention alone runs on all --gpus)")
    _check_step_options(args, whole and not args.attention_only)
    with blame("--dp"):
        from ..plan.models import check_dp

        check_dp(args.dp, args.gpus)
    from ..layout import local_multiple

    need = args.gpus // args.dp * local_multiple(args.layout)
    if not args.longest and args.seq_len % need:
        raise BadOption(
            "--seq-len",
            f"{args.seq_len} does not split over {args.gpus // args.dp} sequence ranks with layout "
            f"{args.layout!r} (use a multiple of {need})",
        )
    per_node = min(args.gpus, args.gpus_per_node)
    if args.gpus % per_node:
        raise BadOption(
            "--gpus", f"{args.gpus} is not a multiple of --gpus-per-node {args.gpus_per_node} (whole nodes only)"
        )
    heads = model_of(args).heads if whole else args.heads
    if args.kv_heads is not None and heads % args.kv_heads:
        raise BadOption("--kv-heads", f"{args.kv_heads} does not divide {heads} query heads (use a divisor)")
    with blame("--profile"):
        from ..plan import profile

        profile(args.profile)  # `local` reads a saved calibration
    check_writable_file("--json", args.json)


def _check_longest_first(args) -> None:
    """--longest plans the flags of one `burst train --nproc 1` run, one bf16 sequence a step: the
    options that would plan anything else raise rather than pass unused."""
    if args.gpus > 1:
        raise BadOption(
            "--gpus",
            "--longest plans one GPU's longest step (`burst train --nproc 1`): give --gpus 1, or plan a "
            "length on several GPUs with --seq-len",
        )
    if args.batch != 1:
        raise BadOption("--batch", "--longest plans one sequence a step: give it without --batch")
    if args.dtype_bytes not in (None, 2):
        raise BadOption("--dtype-bytes", "--longest plans `burst train --dtype bfloat16` (2 bytes): leave it out")
    if args.attention_only:
        raise BadOption("--attention-only", "--longest plans the whole model's training step: leave it out")
    options = ("hidden", "ffn_hidden", "vocab", "heads", "kv_heads", "head_dim", "layers", "window")
    for option in options:
        if getattr(args, option) is not None:  # its advice would be for a model `burst train --model` cannot run
            raise BadOption(
                f"--{option.replace('_', '-')}", "--longest plans `burst train --model` as it is: leave it out"
            )
    for option in ("layout", "gpus_per_node", "intra_node_gbps"):
        if getattr(args, option) is not None:  # no layout, no link on one GPU
            raise BadOption(
                f"--{option.replace('_', '-')}", "--longest plans one GPU, where nothing reads it: leave it out"
            )


def _check_step_options(args, whole: bool) -> None:
    """A whole model's step options where nothing reads them raise, never pass unused: attention alone
    has no checkpointing, loss, FSDP or optimizer; a prefill no backward or optimizer; --longest picks
    them itself, per memory option."""
    given = {
        "--checkpointing": args.checkpointing != "none",
        "--unfused-loss": args.unfused_loss,
        "--no-fsdp": args.no_fsdp,
        "--offload-optimizer": args.offload_optimizer,
        "--no-backward-overlap": args.no_backward_overlap,
        "--host-mem-gib": args.host_mem_gib is not None,
    }
    named = [option for option, on in given.items() if on]
    if named and not whole:
        raise BadOption(named[0], "plans a whole model's step: give --model or --hidden (attention alone has none)")
    chosen = [o for o in named if o != "--host-mem-gib"] + (["--dp"] if args.dp > 1 else [])
    if args.longest and chosen:
        raise BadOption(chosen[0], "--longest tries each of `burst train`'s memory options itself: give it alone")
    if args.longest and args.mode != "train":
        raise BadOption("--mode", "--longest plans training steps")
    training = [
        o for o in named if o in ("--checkpointing", "--unfused-loss", "--offload-optimizer", "--no-backward-overlap")
    ]
    if args.mode == "prefill" and training:
        raise BadOption(training[0], "applies to training: a prefill has no backward, loss or optimizer step")


def _check_config_path(value: str) -> None:
    """One line for a config that is not there: a path that does not exist (absolute, ./, ../, ~ or *.json: not a
    hub id, which transformers would look up on the network), or a folder without config.json."""
    path = os.path.expanduser(value)
    looks_like_a_path = os.path.isabs(path) or value.startswith((".", "~")) or value.endswith(".json")
    if looks_like_a_path and not os.path.exists(path):
        raise BadOption("--hf-config", f"no such file or folder: {value}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise BadOption("--hf-config", f"the folder {value} has no config.json")


def _apply_hf_config(args) -> None:
    """--hf-config: the config's attention shapes into the shape flags not given, and the numbers per
    token its sparse attention gathers (burst.plan.sparse) into args.gathered."""
    if args.model is not None or args.hidden is not None:
        raise BadOption(
            "--hf-config", "plans a transformers config's attention alone: give it without --model / --hidden"
        )
    _check_config_path(args.hf_config)
    try:
        from transformers import AutoConfig
    except ImportError as err:  # the extra is missing: one line that names it, not a traceback
        raise BadOption(
            "--hf-config",
            "needs transformers: pip install 'transformers>=5.23.0,<6' "
            "(or, from a clone of burst, pip install '.[hf]')",
        ) from err
    with blame("--hf-config"):
        from ..plan.latent import latent_of
        from ..plan.sparse import entries_per_query, gathered_numbers, indexer_macs, windowed_layers

        config = AutoConfig.from_pretrained(args.hf_config)
        text = config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        qk = getattr(text, "qk_nope_head_dim", 0) + getattr(text, "qk_rope_head_dim", 0)
        head_dim = (
            max(qk, getattr(text, "v_head_dim", 0))
            if qk and getattr(text, "kv_lora_rank", None)
            else getattr(text, "head_dim", None) or text.hidden_size // heads
        )
        shapes = {
            "heads": heads,
            "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
            "head_dim": head_dim,
            "layers": text.num_hidden_layers,
        }
        args.latent = latent_of(text)  # MLA: burst moves the latent (plan/latent.py)
        args.gathered = gathered_numbers(config)
        args.entries = entries_per_query(config, args.seq_len)
        args.indexer_macs = indexer_macs(config, args.seq_len)
        window, args.windowed_share = windowed_layers(text)
        if window is not None and not args.causal:  # it would be planned as full attention, the window dropped
            raise BadOption(
                "--hf-config", f"its layers slide a {window}-token window over causal attention: give --causal"
            )
        shapes["window"] = window
    for option, value in shapes.items():
        if getattr(args, option) is None:
            setattr(args, option, value)


def model_of(args):
    """The ModelConfig of --model / --hidden with the shape flags given applied."""
    from dataclasses import replace

    from ..engine.model import ModelConfig
    from ..plan import model_config

    if args.model is not None:
        cfg = model_config(args.model)
    else:
        cfg = ModelConfig(
            vocab_size=args.vocab,
            dim=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads or args.heads,
            ffn_dim=args.ffn_hidden,
        )
    given = {
        "vocab_size": args.vocab,
        "dim": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "ffn_dim": args.ffn_hidden,
    }
    cfg = replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if args.heads is not None and args.kv_heads is None and cfg.heads % cfg.kv_heads:
        cfg = replace(cfg, kv_heads=cfg.heads)
    return cfg
