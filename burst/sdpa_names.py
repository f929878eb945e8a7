"""The names code calls torch's scaled_dot_product_attention (SDPA) by, each replaced while a
burst.context_parallel context is open (`routed`).

torch's own name, torch.nn.functional.scaled_dot_product_attention, which torch's modules and transformers
call; and the module-level names other code bound to torch's function (`from torch.nn.functional import
scaled_dot_product_attention as sdpa`), found by reading every loaded module's globals outside torch and
burst (a few milliseconds). A name is looked up when the call runs, so a replaced one routes everywhere
the call runs: eagerly, under torch.compile (which traces what the name holds then), and in an activation
checkpoint's recomputation (which the context's torch function mode does not see: it runs with the mode
off). SDPA held elsewhere (a closure, an attribute, a functools.partial, torch._C._nn's) reaches the
context's mode only: routed eagerly and compiled, not in a recomputation (context_parallel warns once).
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn.functional as F

# torch's SDPA itself, taken before any context replaces the name F.scaled_dot_product_attention
TORCH_SDPA = F.scaled_dot_product_attention

_SKIPPED = ("torch", "burst")  # packages whose own references to SDPA are theirs to keep
_MAIN_NAMES = ("__main__", "__mp_main__")  # the script run as a program, and as multiprocessing starts it


def module_aliases() -> list[tuple[dict, str]]:
    """(a loaded module's globals, a name in them) for each module-level name bound to torch's SDPA outside
    torch and burst."""
    found = []
    for namespace in _loaded_namespaces():
        found += [(namespace, key) for key, value in list(namespace.items()) if value is TORCH_SDPA]
    return found


def _loaded_namespaces() -> list[dict]:
    """The globals of every loaded module outside torch and burst, and those the main script's functions
    read: a script that multiprocessing's spawn or forkserver starts a rank from runs as __mp_main__, whose
    functions keep the globals of the run that defined them, a dict no module holds (runpy returns a copy)."""
    namespaces = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if name.split(".")[0] in _SKIPPED or not isinstance(namespace, dict):
            continue
        namespaces[id(namespace)] = namespace
        if name in _MAIN_NAMES:
            for value in list(namespace.values()):
                if isinstance(value, types.FunctionType) and value.__module__ == name:
                    namespaces.setdefault(id(value.__globals__), value.__globals__)
    return list(namespaces.values())


@contextlib.contextmanager
def routed(to):
    """torch.nn.functional.scaled_dot_product_attention and every module-level alias of it are `to` while
    open, torch's own again after."""
    # torch.compile applies a torch function mode only to the functions torch lists as overridable, a list
    # made once by reading the names of torch's namespaces: made while the name is burst's, it would lack
    # torch's SDPA, and SDPA held under another name would reach the graph unrouted. Made first.
    torch.overrides.get_overridable_functions()
    names = [(vars(F), "scaled_dot_product_attention"), *module_aliases()]
    saved = [namespace[key] for namespace, key in names]
    for namespace, key in names:
        namespace[key] = to
    try:
        yield
    finally:
        for (namespace, key), value in zip(names, saved):
            namespace[key] = value
