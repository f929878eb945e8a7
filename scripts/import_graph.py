"""The import graph of the burst package, file by file: its circles and its files over 400 lines.

    .venv/bin/python scripts/import_graph.py            # circles and long files; exit status 1 if any
    .venv/bin/python scripts/import_graph.py --edges    # also every file's imports

Static: each .py under burst/ is parsed with `ast`, never imported. Every import statement counts,
at module level or inside a function (a deferred import still ties two files together; deferring it
only hides the circle from the interpreter), relative ones resolved against the file's package. An
import points at the file of the module it names: `from .masks import Tile` at burst/masks/__init__.py
(or burst/masks.py), `from .masks import planner` at burst/masks/planner.py. The parent packages that
Python runs first are not counted: every package's __init__.py imports its own modules, so counting
them would put each module in a circle with its package. Imports of other packages (torch, ...) are
left out.

A circle is a strongly connected component of more than one file (Tarjan's algorithm).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
MAX_LINES = 400


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package` (a directory with __init__.py)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` (file `path`) imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(_known_prefix(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, name, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else _known_prefix(base, known))  # a module, or a name in one
    out.discard(None)
    return out


def _absolute(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """`from <level dots><module> import ...` written in module `importer`, as an absolute name."""
    if level == 0:
        return module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _known_prefix(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a module of `known` (None: another package)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def graph(package: Path = ROOT / "burst") -> dict[str, set[str]]:
    """File -> files it imports, as paths relative to the repository (burst/api.py)."""
    known = modules(package)
    rel = {name: path.relative_to(package.parent).as_posix() for name, path in known.items()}
    return {rel[name]: {rel[m] for m in imported(name, path, known) if m != name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file, each sorted, largest first (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * len(edges) + 100))  # depth is at most the number of files
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found, key=lambda c: (-len(c), c))


def long_files(package: Path = ROOT / "burst", max_lines: int = MAX_LINES) -> list[tuple[str, int]]:
    """(file relative to the repository, lines) for each .py under `package` longer than `max_lines`."""
    out = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > max_lines:
            out.append((path.relative_to(package.parent).as_posix(), lines))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, default=ROOT / "burst", help="the package directory (default burst/)")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES, help=f"longest file allowed (default {MAX_LINES})")
    parser.add_argument("--edges", action="store_true", help="also print every file's imports")
    args = parser.parse_args(argv)
    edges = graph(args.package)
    if args.edges:
        for source in sorted(edges):
            print(f"{source} -> {', '.join(sorted(edges[source])) or '-'}")
        print()
    found = cycles(edges)
    print(f"{len(edges)} files, {sum(map(len, edges.values()))} imports, {len(found)} circle(s)")
    for component in found:
        print(f"circle of {len(component)}: {' '.join(component)}")
        for source in component:
            inside = sorted(edges[source] & set(component))
            print(f"    {source} -> {', '.join(inside)}")
    long = long_files(args.package, args.max_lines)
    print(f"{len(long)} file(s) over {args.max_lines} lines")
    for path, lines in long:
        print(f"    {path}: {lines}")
    return 1 if found or long else 0


if __name__ == "__main__":
    sys.exit(main())
