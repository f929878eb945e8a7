"""The argument types of the `burst` verbs: each catches a value on its own at parse time, and argparse
turns its ArgumentTypeError into the verb's one-line error naming the option (cli/common.py)."""

from __future__ import annotations

import argparse
import math


def _number(kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _number_where(kind, holds, expectation: str, name: str, doc: str):
    """An argument type: a number of `kind` for which holds(value), else "EXPECTATION, got TEXT"."""

    def parse(text: str):
        value = _number(kind, text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"{expectation}, got {value if kind is int else text}")
        return value

    parse.__name__, parse.__doc__ = name, doc
    return parse


positive_int = _number_where(int, lambda v: v >= 1, "must be at least 1", "positive_int", "An int of 1 or more.")
nonnegative_int = _number_where(int, lambda v: v >= 0, "must be 0 or more", "nonnegative_int", "An int of 0 or more.")
positive_float = _number_where(
    float, lambda v: v > 0, "must be a positive number", "positive_float", "A finite number above 0."
)
nonnegative_float = _number_where(
    float, lambda v: v >= 0, "must be 0 or more", "nonnegative_float", "A finite number of 0 or more."
)
probability = _number_where(
    float, lambda v: 0 < v <= 1, "must lie in (0, 1]", "probability", "A probability mass in (0, 1] (top-p)."
)


def int_pair(text: str) -> tuple[int, int]:
    """LEFT,RIGHT as two ints (a sliding window; -1 = unbounded)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (two ints, -1 = unbounded), got {text!r}")
    left, right = (_number(int, p) for p in parts)
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"each side must be -1 (unbounded) or 0 or more, got {text!r}")
    return left, right


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive ints."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, got nothing")
    return tuple(positive_int(p) for p in text.split(","))


def name_list(choices) -> callable:
    """Comma-separated names, each one of `choices` (any case)."""
    by_lower = {c.lower(): c for c in choices}

    def parse(text: str) -> tuple[str, ...]:
        names = [p.strip() for p in text.split(",")]
        if not any(names):
            raise argparse.ArgumentTypeError(f"expected comma-separated names of {', '.join(choices)}, got nothing")
        if not all(names):
            raise argparse.ArgumentTypeError(f"an empty name in {text!r} (names are separated by single commas)")
        for name in names:
            if name.lower() not in by_lower:
                raise argparse.ArgumentTypeError(f"unknown name {name!r} (choose from {', '.join(choices)})")
        chosen = tuple(by_lower[n.lower()] for n in names)
        refuse_repeats(chosen)
        return chosen

    return parse


def refuse_repeats(names) -> None:
    """ArgumentTypeError for a name given twice (`--strategies burst,burst` ran every case twice)."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} named twice")


def any_case(choices) -> callable:
    """One of `choices`, in any case (`--profile h100`)."""
    by_lower = {c.lower(): c for c in choices}

    def parse(text: str) -> str:
        if text.lower() not in by_lower:
            raise argparse.ArgumentTypeError(f"unknown {text!r} (choose from {', '.join(choices)})")
        return by_lower[text.lower()]

    return parse


def dtype_name(allowed) -> callable:
    """One dtype of `allowed` (canonical names), written any way devices.DTYPE_ALIASES reads ("bf16",
    "BFloat16"), as its canonical name ("bfloat16"): the one spelling the verb's code then sees."""
    from ..devices import canonical_dtype

    def parse(text: str) -> str:
        try:
            return canonical_dtype(text, allowed)
        except ValueError as err:  # argparse names the option itself
            raise argparse.ArgumentTypeError(str(err).removeprefix("--dtype: ")) from None

    return parse


def dtype_names(allowed) -> callable:
    """Comma-separated dtypes of `allowed`, each as dtype_name reads it; canonical, each once, in order."""
    one = dtype_name(allowed)

    def parse(text: str) -> tuple[str, ...]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        if not names:
            from ..devices import dtype_listing

            raise argparse.ArgumentTypeError(f"expected comma-separated dtypes ({dtype_listing(allowed)}), got nothing")
        return tuple(dict.fromkeys(one(name) for name in names))

    return parse
