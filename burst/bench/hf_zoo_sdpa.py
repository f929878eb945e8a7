"""The SDPA door for the families the transformers backend refuses whole (issue 68 item 5).

transformers marks some families as not running on custom attention backends
(`_supports_attention_backend = False`: Bloom, MPT, the BART family, XGLM...), and Falcon, GPT-Neo and GIT
pick their attention classes by name; burst's backend refuses all of them. Built with
attn_implementation="sdpa" instead, a family calls torch's scaled_dot_product_attention, which burst's
drop-in `burst.context_parallel` routes to burst.attention. This runs each family's tiny zoo config
(burst/bench/hf_zoo_configs.py) that way at 2 ranks, contiguous and zigzag, as a user would:

    with burst.context_parallel(buffers=(ids, positions, labels), buffer_seq_dims=(1, 1, 1), layout=layout):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = cross_entropy(logits, labels, reduction="sum") / count   # labels shifted before sharding
        loss.backward()                                                 # then all-reduce the gradients

against the same weights with eager attention in one process: logits, loss and every parameter's gradient
(hf_steps.gradient_error). Outcomes: exact (within hf_zoo's tolerances); refused by the door (an explicit
attn_mask, which covers one rank's tokens only, or positions numbered from the shard's own length:
burst.context_parallel raises on every rank); not built (transformers does not build the family with
"sdpa"); silent (ran and differs: something the model does outside SDPA that the door cannot see).
`python -m burst.bench.hf_zoo_sdpa` writes the table (benchmarks/hf_zoo_sdpa.md).
"""

from __future__ import annotations

import copy

import torch

from .hf_steps import gradient_error, twin_on
from .hf_zoo import GRADIENT_TOLERANCE, RETRIES, TOLERANCE, VOCAB, causal_lm, draw, tiny_config

SEQ = 128
BY_NAME = ("falcon", "gpt_neo", "git")  # attention classes picked by implementation name


def refused_families() -> list[str]:
    """The causal-LM families burst's backend refuses whole: those transformers marks as not running on custom
    attention backends (but the hybrids burst splits, FAMILIES, and checks.CALLS_THE_INTERFACE), and those
    that pick their attention classes by name; sorted."""
    import importlib

    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ..integrations.transformers import FAMILIES
    from ..integrations.transformers.backend.checks import CALLS_THE_INTERFACE

    out = set(BY_NAME)
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        module = CONFIG_MAPPING[model_type].__module__.replace("configuration_", "modeling_")
        try:
            cls = getattr(importlib.import_module(module), class_name)
        except Exception:  # noqa: BLE001 - a family whose modeling module does not import here
            continue
        if (
            getattr(cls, "_supports_attention_backend", True) is False
            and model_type not in CALLS_THE_INTERFACE
            and model_type not in FAMILIES
        ):
            out.add(model_type)
    return sorted(out & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def _config(model_type: str):
    for keep in RETRIES:
        try:
            config = tiny_config(model_type, keep)
            causal_lm(model_type, copy.deepcopy(config))
            return config
        except Exception:  # noqa: BLE001 - the next retry keeps more defaults
            continue
    return tiny_config(model_type)


def through_the_door(model_type: str, layout: str, group=None) -> tuple[str, str]:
    """(outcome, detail) of one family through burst.context_parallel over `group`; call on every rank."""
    import torch.distributed as dist

    import burst
    from burst import layout as layout_mod

    config = _config(model_type)
    torch.manual_seed(0)
    eager = causal_lm(model_type, copy.deepcopy(config), attn_implementation="eager").eval()
    draw(model_type, eager)
    try:  # built anew with "sdpa", as a user builds it: transformers refuses it there for some families
        model = twin_on(model_type, eager, config, "sdpa", switch=False).eval()
    except Exception as err:  # noqa: BLE001 - transformers' own refusal of "sdpa" for the family
        return "not built", _first_line(err)
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)

    def loss_of(logits, targets):
        return torch.nn.functional.cross_entropy(logits[0].float(), targets[0], ignore_index=-100, reduction="sum") / (
            SEQ - 1
        )

    expected = eager(input_ids=ids, position_ids=torch.arange(SEQ)[None], use_cache=False).logits
    expected_loss = loss_of(expected, labels)
    expected_loss.backward()
    x, positions, targets = ids.clone(), torch.arange(SEQ)[None].clone(), labels.clone()
    try:
        with burst.context_parallel(
            buffers=(x, positions, targets), buffer_seq_dims=(1, 1, 1), layout=layout, group=group
        ):
            logits = model(input_ids=x, position_ids=positions, use_cache=False).logits
            loss = loss_of(logits, targets)
            loss.backward()
    except ValueError as err:
        return "refused by the door", _first_line(err)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    whole = layout_mod.unshard(logits.detach().contiguous(), group=group, layout=layout, dim=1)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    difference = max((whole - expected).abs().max().item(), abs(total.item() - expected_loss.item()))
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()) if q.grad is not None]
    if any(p is None for p, _ in pairs):
        return "silent", "a parameter eager differentiates got no gradient"
    error = gradient_error(pairs)
    if difference <= TOLERANCE and error <= GRADIENT_TOLERANCE:
        return "exact", f"{difference:.1e}, gradients {error:.1e}"
    return "silent", f"logits/loss {difference:.1e} off, gradients {error:.1e}"


def door_world(rank: int, world: int, model_types=None, layouts=("contiguous", "zigzag")) -> dict:
    """{family: {layout: (outcome, detail)}} as one rank of a local world (burst.launch.spawn_world)."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    return {
        family: {layout: through_the_door(family, layout) for layout in layouts}
        for family in (model_types or refused_families())
    }


def _first_line(err: BaseException) -> str:
    line = next((x.strip() for x in str(err).splitlines() if x.strip()), "")
    text = f"{type(err).__name__}: {line}"
    return text if len(text) <= 150 else text[:147] + "..."


def report(rows: dict, seconds: float) -> str:
    import collections
    import platform

    import transformers

    layouts = list(next(iter(rows.values())))
    counts = collections.Counter(o for by in rows.values() for o, _ in by.values())
    lines = [
        "# The SDPA door for the families burst's transformers backend refuses",
        "",
        "Made by `python -m burst.bench.hf_zoo_sdpa` (burst/bench/hf_zoo_sdpa.py) with transformers "
        f"{transformers.__version__}, torch {torch.__version__}, {platform.machine()} CPU, in {seconds:.0f} s on "
        "2 processes.",
        "",
        "Each family transformers marks as not running on custom attention backends, and those that pick their "
        'attention classes by name (falcon, gpt_neo, git), built tiny with attn_implementation="sdpa" and run '
        f"through `burst.context_parallel` at 2 ranks ({SEQ} tokens) against eager attention in one process: "
        "logits, loss, every gradient. exact: within the zoo's tolerances; refused by the door: an explicit "
        "attn_mask (one rank's tokens only) or positions numbered from the shard's own length, raised on every "
        'rank; not built: transformers does not build the family with "sdpa"; silent: ran and differs, which '
        "the door cannot see (the model computes something outside SDPA from the shard alone).",
        "",
        "Outcomes (family x layout): " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
        "",
        "| family | " + " | ".join(f"2 ranks {x}" for x in layouts) + " |",
        "|---" * (len(layouts) + 1) + "|",
    ]
    for family, by in rows.items():
        lines.append(f"| {family} | " + " | ".join(f"{o}: {d.replace('|', '/')}" for o, d in by.values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse
    import time

    from burst.launch import spawn_world

    parser = argparse.ArgumentParser(description="The SDPA door for the families burst's backend refuses")
    parser.add_argument("--families", default=None, help="comma-separated model types (default: all refused)")
    parser.add_argument("--out", default="benchmarks/hf_zoo_sdpa.md")
    args = parser.parse_args()
    families = args.families.split(",") if args.families else None
    start = time.time()
    rows = spawn_world(door_world, families, nproc=2, threads=1, timeout=1800)[0]
    with open(args.out, "w") as f:
        f.write(report(rows, time.time() - start))
    print(f"wrote {args.out} ({len(rows)} families)")


if __name__ == "__main__":
    main()
