"""The attention implementations registered with burst for transformers: name -> what it runs.

Shared by the training path (transformers.py: register, burst_attention_forward) and generation
(transformers_generate.py: ShardedCache), so neither imports the other to find a registration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class Backend:
    """What one registered name runs: strategy, layout, group and strategy options."""

    strategy: str
    layout: str
    group: dist.ProcessGroup | None
    options: dict = field(default_factory=dict)


BACKENDS: dict[str, Backend] = {}


def backend_of(module) -> tuple[str, Backend]:
    """(name, Backend) of the implementation `module`'s config names (a model or one of its layers)."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if name not in BACKENDS:
        raise ValueError(f"attention implementation {name!r} was not registered with burst "
                         f"(registered: {sorted(BACKENDS)}); call burst.integrations.transformers.register first")
    return name, BACKENDS[name]
