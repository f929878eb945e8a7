"""One row of burst/bench/hf_zoo_real_configs.py's table of published configs (`Case`), and the
shorthands its rows are written with: YaRN and LongRoPE rope parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    name: str  # the row: the family, and what the variant shrank
    model_type: str
    source: str  # the published checkpoint whose config.json `kept` is from
    kept: dict  # its attention-shaping values, as published
    small: dict = field(default_factory=dict)  # family-specific shrinking beyond SMALL (experts, layer kinds)
    heads: tuple[int, int] | None = None  # (query, KV) heads when fewer than published: the ratio kept
    # kept values set after the config is built: Phi3Config checks the LongRoPE lists' length against
    # hidden_size / heads, which no longer is the head dim once hidden_size is shrunk
    after: tuple[str, ...] = ()
    # length-gated values as {dotted key: fraction of n}: the variant sets each to int(fraction * n)
    gated: dict = field(default_factory=dict)
    note: str = ""
    parent: str = ""  # a variant's published case


def yarn(factor, original, theta, **more) -> dict:
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
        "rope_theta": float(theta),
        **more,
    }


def longrope(short, long, original, theta) -> dict:
    return {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": original,
        "rope_theta": float(theta),
    }
