"""The README's transformers example, its lines run as written, at 2 ranks, over families a user
brings: each exact (logits, loss, every gradient against the same model in one process) or refused
with burst's clear error, never silently different. Without `model=` the same line is a TypeError
(tests/test_transformers.py); the zoo (tests/test_hf_zoo.py) runs the same path over every family.
"""

from __future__ import annotations

import pathlib
import re

import torch

from requires import transformers_or_skip
from world import run_world

transformers_or_skip()

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
FAMILIES = (
    "llama",
    "mamba",
    "rwkv",
    "qwen3_next",
    "gemma3_text",
    "openai-gpt",
    "xlm",
    "cpmant",
    "prophetnet",
    "deepseek_v32",
    "deepseek_v4",
)
# tiny float32 models, one process against two ranks: the bounds of tests/test_hf_rope.py and test_hf_hybrid.py
BOUND = {"logits": 2e-5, "loss": 2e-6, "gradients": 1e-4}


def readme_transformers_lines() -> str:
    """The README example's transformers lines: from its `import burst.integrations.transformers` to
    the end of the code block."""
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    start = block.index("import burst.integrations.transformers as bt")
    return block[start:]


def _run_readme(rank, world):
    import copy
    import warnings

    import transformers
    from burst import layout as layout_mod
    from burst.bench import hf_steps, hf_zoo
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    code = readme_transformers_lines()
    outcomes = {}
    for family in FAMILIES:
        if family not in hf_zoo.families():
            outcomes[family] = ("absent", f"this transformers release has no {family}")
            continue
        try:
            config = hf_zoo.tiny_config(family)
            torch.manual_seed(0)
            eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
        except Exception as err:  # noqa: BLE001 - a family that never ran fails the test, saying why
            outcomes[family] = ("not built", f"{type(err).__name__}: {err}")
            continue
        ids = torch.randint(3, hf_zoo.VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
        namespace = {"AutoModelForCausalLM": _loading(eager), "config": copy.deepcopy(config), "ids": ids}
        try:
            exec(code, namespace)  # noqa: S102 - the README's own lines
        except ValueError as err:
            outcomes[family] = ("refused", str(err))
            continue
        expected = eager(input_ids=ids, labels=ids, use_cache=False)
        expected.loss.backward()
        logits = layout_mod.unshard(namespace["out"].logits.contiguous(), layout="zigzag", dim=1)
        pairs = [
            (p.grad, q.grad) for p, q in zip(namespace["model"].parameters(), eager.parameters()) if q.grad is not None
        ]
        outcomes[family] = (
            "ran",
            {
                "logits": (logits - expected.logits).abs().max().item(),
                "loss": abs(namespace["loss"].item() - expected.loss.item()),
                "gradients": hf_steps.gradient_error(pairs),
            },
        )
    return outcomes


def _loading(eager):
    """AutoModelForCausalLM for the README's lines: from_config as transformers does it, then the eager
    twin's weights, so both models hold the same parameters."""
    from transformers import AutoModelForCausalLM

    class Loading:
        @staticmethod
        def from_config(config, **kwargs):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
            model.load_state_dict(eager.state_dict())
            return model

    return Loading


def test_the_readme_example_is_exact_or_refused_for_the_families_a_user_brings():
    assert "model=model" in readme_transformers_lines()
    outcomes = run_world(2, _run_readme)[0]
    assert set(outcomes) == set(FAMILIES), sorted(outcomes)
    failures = []
    for family, (kind, detail) in outcomes.items():
        if kind == "refused":
            if not ("burst" in detail or "attn_implementation" in detail or "use_cache=False" in detail):
                failures.append((family, kind, detail))
        elif kind != "ran":  # absent from this transformers, or its tiny model failed to build: never ran
            failures.append((family, kind, detail))
        elif not all(detail[k] < bound for k, bound in BOUND.items()):
            failures.append((family, kind, detail))
    assert not failures, failures
    assert outcomes["llama"][0] == outcomes["mamba"][0] == "ran"
    for family in ("deepseek_v32", "deepseek_v4"):  # sparse and compressed attention, through the same lines
        assert outcomes[family][0] == "ran", (family, outcomes[family])
    assert outcomes["openai-gpt"][0] == "refused"
