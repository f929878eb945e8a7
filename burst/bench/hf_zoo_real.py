"""The zoo again, from the published configs of the families users shard most (issue 53 item 4).

burst/bench/hf_zoo.py builds every family tiny from its config class's defaults: 16-wide heads, 2 KV
heads, 128 tokens. Here each family keeps what shapes its attention as its published checkpoint's
config.json has it (head dims, the GQA ratio, rope type and parameters, sliding windows and their
layer pattern, chunks, softcaps, sinks, MLA ranks, attention multipliers) and shrinks what does
not: 2 layers (one of each kind where the family alternates), hidden size 64, a narrow MLP, a
256-token vocabulary, few experts. A family with more than MAX_HEADS query heads keeps its GQA
ratio with fewer (the eager reference materialises heads x n x n scores in one process).

Each case is compared at n tokens (4096 in the benchmark), split over 2 and 4 ranks in the contiguous
and the zigzag layout, against the same weights with eager attention in one process: the max abs
difference of the logits and of the loss, and burst.bench.hf_steps.gradient_error over every parameter's
gradient. Where a published window, chunk, temperature floor or LongRoPE original length is n or
longer (so it changes nothing at n tokens), a variant runs it shrunk to a fraction of n so it bites.

    from burst.bench.hf_zoo_real import CASES, cases_at, run
    references, rows = run(cases_at(4096), 4096)  # {case: Reference}, {case: {setting: Result}}

The reference runs once per case in this process (saved to a folder); each world loads the weights
and the reference and returns only the errors. benchmarks/hf_zoo_real.py writes the table;
tests/test_hf_zoo_real.py runs a few cases at 1024 tokens on 2 ranks. The cases, with the published values
written out, are in hf_zoo_real_configs.py.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .hf_zoo_real_configs import CASES, PUBLISHED, Case

__all__ = [
    "BOUND",
    "CASES",
    "PUBLISHED",
    "Case",
    "Reference",
    "Result",
    "build_config",
    "cases_at",
    "describe",
    "eager_logits",
    "reference",
    "run",
    "sharded",
    "sharded_world",
    "variant",
]

VOCAB = 256
MAX_HEADS = 32
BOUND = {"logits": 2e-4, "loss": 2e-5, "gradients": 1e-3}  # tests/test_hf_flagships.py's
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
ZEROED = ("attention_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout", "dropout")


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def _set(d: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for part in path:
        d = d[part]
    d[last] = value


def variant(case: Case, seq_len: int) -> Case | None:
    """The case with each gated value that does not bite at seq_len (>= seq_len) shrunk to its
    fraction of seq_len; None when every published value already bites."""
    if not any(_get(case.kept, key) >= seq_len for key in case.gated):
        return None
    kept = copy.deepcopy(case.kept)
    biting = [key for key, fraction in case.gated.items() if _get(case.kept, key) >= seq_len]
    for key in biting:
        _set(kept, key, int(case.gated[key] * seq_len))
    shrunk = ", ".join(
        f"{key.split('.')[-1]} {_get(case.kept, key)} -> {_get(kept, key)}"
        for key in biting
        if not key.startswith("rope_parameters.")
    )
    return dataclasses.replace(case, name=f"{case.name} ({shrunk})", kept=kept, gated={}, parent=case.name)


def cases_at(seq_len: int, names=None) -> list[Case]:
    """The published cases (or those named), each followed by its variant where one is needed at seq_len."""
    out = []
    for case in (CASES[n] for n in names) if names else PUBLISHED:
        out.append(case)
        shrunk = variant(case, seq_len)
        if shrunk is not None:
            out.append(shrunk)
    return out


def eager_logits(case: Case, seq_len: int) -> torch.Tensor:
    """The case's eager model (seed 0, the reference's weights) on token_ids(seq_len): logits, forward only."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(case), attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids=token_ids(seq_len), use_cache=False).logits


def build_config(case: Case):
    """The family's config class with the case's published attention values and the small sizes."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[case.model_type]
    values = {**copy.deepcopy(case.kept), **SMALL, **case.small}
    if case.heads is not None:
        values["num_attention_heads"], values["num_key_value_heads"] = case.heads
    later = {key: values.pop(key) for key in case.after}
    config = cls(**values)  # head_dim too where the class has no field for it (Qwen2, Phi-3, Granite, OLMo 2)
    for key, value in later.items():
        setattr(config, key, value)
    if "rope_parameters" in later:
        config.standardize_rope_params()
    for attr in ZEROED:
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, attr, 0)
    return config


def token_ids(seq_len: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))


@dataclass
class Reference:
    """What the eager model in one process gave (saved beside it: weights, logits, loss, gradients)."""

    case: str
    seconds: float = 0.0
    parameters: int = 0
    skip: str = ""  # the eager model does not build or run: why
    moved: float | None = None  # a variant: max |logits - its published case's logits| (what the shrinking changed)


@dataclass
class Result:
    outcome: str  # exact | refused | silent | crash
    errors: dict = field(default_factory=dict)  # logits, loss, gradients
    detail: str = ""  # the refusal's or the crash's first line, or what exceeded the bound
    seconds: float = 0.0


def reference(case: Case, seq_len: int, path: str) -> Reference:
    """The case's eager model (seed 0) on token_ids(seq_len): forward, loss, backward, saved to path."""
    from transformers import AutoModelForCausalLM

    from .hf_zoo import _first_line

    start = time.time()
    try:
        config = build_config(case)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
        ids = token_ids(seq_len)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
    except Exception as err:  # noqa: BLE001 - the family's own limits, recorded
        return Reference(case.name, time.time() - start, skip=f"eager model does not build or run: {_first_line(err)}")
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    torch.save(
        {"state": model.state_dict(), "logits": out.logits.detach(), "loss": out.loss.item(), "grads": grads}, path
    )
    parameters = sum(p.numel() for p in model.parameters())
    del model, out, grads
    gc.collect()
    return Reference(case.name, time.time() - start, parameters)


def sharded(case: Case, seq_len: int, saved: dict, name: str, layout: str, group=None) -> Result:
    """The case on the registered burst backend `name` over `group` (every rank alike), against the
    saved eager reference."""
    from transformers import AutoModelForCausalLM

    from .hf_steps import gradient_error, sharded_step
    from .hf_zoo import _first_line, _raised_by_burst

    start = time.time()
    model = AutoModelForCausalLM.from_config(build_config(case), attn_implementation=name)
    model.load_state_dict(saved["state"])
    ids = token_ids(seq_len)
    try:
        logits, loss = sharded_step(model, ids, layout, group)
    except Exception as err:  # noqa: BLE001 - classified: burst's own clear error, or a crash
        kind = "refused" if _raised_by_burst(err) else "crash"
        return Result(kind, detail=_first_line(err), seconds=time.time() - start)
    pairs, missing = [], []
    for pname, p in model.named_parameters():
        expected = saved["grads"].get(pname)
        if expected is None:
            continue
        if p.grad is None:
            missing.append(pname)
            pairs.append((torch.zeros_like(expected), expected))
        else:
            pairs.append((p.grad, expected))
    errors = {
        "logits": (logits - saved["logits"]).abs().max().item(),
        "loss": abs(loss - saved["loss"]),
        "gradients": gradient_error(pairs),
    }
    over = [k for k in BOUND if not errors[k] <= BOUND[k]]
    detail = ", ".join(f"{k} {errors[k]:.2e} > {BOUND[k]:g}" for k in over)
    if missing:
        detail = (detail + "; " if detail else "") + f"no gradient on {len(missing)} parameters ({missing[0]}, ...)"
    outcome = "exact" if not over and not missing else "silent"
    return Result(outcome, errors, detail, time.time() - start)


def sharded_world(
    rank: int, world: int, cases: list[Case], seq_len: int, folder: str, layouts=("contiguous", "zigzag")
) -> dict:
    """Every case (those with a saved reference in `folder`) in each layout, as one rank of a local
    world: {(case name, "<world> ranks <layout>"): Result}."""
    import warnings

    import transformers

    import burst.integrations.transformers as bt

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    backends = {layout: bt.register(f"real_zoo_{layout}", layout=layout) for layout in layouts}
    out = {}
    for case in cases:
        path = _saved_path(folder, case.name)
        if not os.path.exists(path):
            continue
        saved = torch.load(path, weights_only=False)
        for layout, backend in backends.items():
            out[(case.name, f"{world} ranks {layout}")] = sharded(case, seq_len, saved, backend, layout)
            gc.collect()
    return out


def _saved_path(folder: str, case_name: str) -> str:
    return os.path.join(folder, "".join(c if c.isalnum() else "_" for c in case_name) + ".pt")


def run(
    cases: list[Case],
    seq_len: int,
    worlds=(2, 4),
    layouts=("contiguous", "zigzag"),
    log: Callable[[str], None] = lambda line: None,
    timeout: float = 4 * 3600,
):
    """Each case's eager reference here, then each world size's ranks on every case:
    ({case: Reference}, {case: {"<world> ranks <layout>": Result}})."""
    from burst.launch import spawn_world

    references, rows = {}, {case.name: {} for case in cases}
    with tempfile.TemporaryDirectory(prefix="burst_real_zoo_") as folder:
        for case in cases:
            references[case.name] = ref = reference(case, seq_len, _saved_path(folder, case.name))
            log(f"eager {case.name}: {ref.skip or f'{ref.seconds:.0f} s'}")
        for case in cases:  # what each variant's shrinking changes: burst ignoring it would be off by this
            if case.parent and not references[case.name].skip:
                parent = references.get(case.parent)
                theirs = (
                    torch.load(_saved_path(folder, case.parent))["logits"]
                    if parent and not parent.skip
                    else eager_logits(CASES[case.parent], seq_len)
                )
                ours = torch.load(_saved_path(folder, case.name))["logits"]
                references[case.name].moved = (ours - theirs).abs().max().item()
        runnable = [case for case in cases if not references[case.name].skip]
        for world in worlds:
            start = time.time()
            by_rank = spawn_world(
                sharded_world, runnable, seq_len, folder, layouts, nproc=world, threads=1, timeout=timeout
            )
            for (case_name, setting), result in by_rank[0].items():
                others = [r[(case_name, setting)] for r in by_rank[1:]]
                if any(o.outcome != result.outcome for o in others):  # ranks must agree on what happened
                    result = Result(
                        "crash",
                        result.errors,
                        "ranks disagree: " + ", ".join(o.outcome for o in [result, *others]),
                        result.seconds,
                    )
                rows[case_name][setting] = result
            log(f"{world} ranks: {time.time() - start:.0f} s")
    return references, rows


def describe(case: Case) -> tuple[str, str]:
    """(what was kept, what was shrunk) in words, for the table."""
    kept = []
    for key, value in case.kept.items():
        if key == "rope_parameters":
            kept.append("rope " + _rope_words(value))
        elif key not in ("max_position_embeddings",):
            kept.append(f"{key} {value}")
    if case.note:
        kept.append(case.note)
    shrunk = [
        f"{SMALL['num_hidden_layers']} layers"
        + (f" ({', '.join(case.small['layer_types'])})" if "layer_types" in case.small else ""),
        f"hidden {SMALL['hidden_size']}",
        f"MLP {SMALL['intermediate_size']}",
        f"vocab {VOCAB}",
    ]
    shrunk += [f"{k} {v}" for k, v in case.small.items() if k != "layer_types"]
    if case.heads is not None:
        published = (case.kept["num_attention_heads"], case.kept["num_key_value_heads"])
        kept = "one KV head kept" if published[1] == 1 else "ratio kept"
        shrunk.append(f"**heads {published[0]}/{published[1]} -> {case.heads[0]}/{case.heads[1]}** ({kept}; time)")
    return "; ".join(kept), "; ".join(shrunk)


def _rope_words(rope: dict) -> str:
    if all(isinstance(v, dict) for v in rope.values()):
        return " / ".join(f"{kind}: {_rope_words(v)}" for kind, v in rope.items())
    parts = []
    for key, value in rope.items():
        if isinstance(value, list):
            parts.append(f"{key}[{len(value)}]")
        elif key != "rope_type":
            parts.append(f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}")
    return f"{rope.get('rope_type', 'default')} (" + ", ".join(parts) + ")"
