"""The house rules of the burst package (issue 52), read by scripts/import_graph.py: no import circle
and no file over 400 lines.

ALLOWED names what may still break them; it was emptied one entry per fix, and empty, this test holds
the whole package to both rules. The script's own functions are checked first on a small package
made here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Paths (a folder ends in "/") whose files may still sit in an import circle or run over 400 lines.
# Delete an entry when its fix lands; an empty tuple means no circle anywhere and no long file in burst/.
# (burst/integrations/ was the last entry: the transformers backend became a package whose parts import
# one way, and its long files were split.)
ALLOWED: tuple[str, ...] = ()


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _allowed(path: str, allowed) -> bool:
    return any(path == a or (a.endswith("/") and path.startswith(a)) for a in allowed)


def house_problems(package: Path = ROOT / "burst", allowed=ALLOWED) -> list[str]:
    """The circles with a file outside `allowed`, and the files over 400 lines outside it, as lines."""
    graph = _import_graph()
    problems = [
        f"circle: {' '.join(c)}"
        for c in graph.cycles(graph.graph(package))
        if not all(_allowed(path, allowed) for path in c)
    ]
    problems += [f"{path}: {lines} lines" for path, lines in graph.long_files(package) if not _allowed(path, allowed)]
    return problems


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


def test_the_script_finds_circles_through_relative_and_deferred_imports(tmp_path):
    graph = _import_graph()
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .a import f\n",
            "pkg/a.py": "from . import b\n\ndef f():\n    pass\n",
            "pkg/b.py": "import torch\n\ndef g():\n    from .a import f  # deferred: still an edge\n",
            "pkg/c.py": "from .sub import d\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/d.py": "from ..c import x\nimport pkg.a\n",
            "pkg/long.py": "x = 1\n" * 401,
        },
    )
    edges = graph.graph(package)
    assert edges["pkg/__init__.py"] == {"pkg/a.py"}
    assert edges["pkg/b.py"] == {"pkg/a.py"}  # torch is another package's
    assert edges["pkg/sub/d.py"] == {"pkg/c.py", "pkg/a.py"}
    assert graph.cycles(edges) == [["pkg/a.py", "pkg/b.py"], ["pkg/c.py", "pkg/sub/d.py"]]
    assert graph.long_files(package) == [("pkg/long.py", 401)]
    assert graph.main(["--package", str(package)]) == 1
    assert house_problems(package, allowed=("pkg/a.py", "pkg/b.py", "pkg/sub/", "pkg/long.py")) == [
        "circle: pkg/c.py pkg/sub/d.py"
    ]  # a circle counts unless all its files are allowed

    clean = _write(tmp_path / "clean", {"pkg/__init__.py": "from .a import f\n", "pkg/a.py": "def f():\n    pass\n"})
    assert graph.main(["--package", str(clean)]) == 0


def test_burst_has_no_import_circle_and_no_long_file_outside_the_allow_list():
    assert house_problems() == []


def test_the_suites_longest_first_names_modules_that_exist():
    """tests/conftest.py's LONGEST_FIRST orders the two-worker run (scripts/test.sh): a module renamed
    or removed must leave it too, or the order it claims goes stale without a word."""
    from conftest import LONGEST_FIRST

    tests = Path(__file__).parent
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [name for name in LONGEST_FIRST if not (tests / f"{name}.py").is_file()] == []
