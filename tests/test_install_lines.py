"""Every install line a user reads works as written (issue 69 item 3).

The lines are read from README.md, docs/, examples/, scripts/ and burst's own messages (its .py files,
with the f-string constants they name filled in). Each `pip install` must be one of the forms
docs/install.md gives:

* from the tree, run at the clone's root: `pip install .`, `pip install '.[EXTRAS]'`, `pip install -e
  '.[EXTRAS]'`, with extras pyproject.toml defines;
* a wheel built from the tree: `pip install 'dist/burst_attention-VERSION-py3-none-any.whl[EXTRAS]'`,
  VERSION pyproject's;
* what an extra brings, by its own name: each requirement exactly as pyproject.toml writes it
  (`'transformers>=5.23.0,<6' 'accelerate>=1.1'`, `matplotlib`), or the flash-attn package burst
  drives (2.7 or newer, not an extra);
* the published form `burst-attention[...]` only on a line that says it is not published yet.

tests/test_wheel.py runs the tree forms (a copy of the clone into a new environment) and checks the
wheel's name; this file is the cheap part: reading and classifying.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OPTIONS = {"-e", "--editable", "-U", "--upgrade", "-q", "--no-build-isolation", "--no-deps"}
FLASH_ATTN = ("flash-attn", "flash_attn")
FLASH_ATTN_SPEC = ">=2.7"  # burst/kernels/cuda_flash_attn.py drives FlashAttention 2.7 or newer
# the words that end a command written inside a sentence ("pip install '.[hf]' from the clone")
_ARG = re.compile(r"""\s+('[^']*'|"[^"]*"|[^\s'"`(),;]+)""")


def pyproject() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)

    # Python 3.10 has no tomllib: the few keys read here, as pyproject.toml writes them (one line each)
    def strings(line: str) -> list[str]:
        return re.findall(r'"([^"]*)"', line.split("=", 1)[1])

    project = {
        "version": strings(re.search(r"^version = .*$", text, re.M).group(0))[0],
        "dependencies": strings(re.search(r"^dependencies = .*$", text, re.M).group(0)),
        "license": {"text": re.search(r'^license = \{ text = "([^"]*)" \}', text, re.M).group(1)},
        "optional-dependencies": {},
    }
    table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    for line in re.findall(r"^\w+ = \[.*\]$", table, re.M):
        project["optional-dependencies"][line.split(" ", 1)[0]] = strings(line)
    return {"project": project}


def _requirements() -> dict[str, str]:
    """Each requirement pyproject.toml names, by its name: the requirement as written there."""
    project = pyproject()["project"]
    every = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {re.match(r"[A-Za-z0-9_.\-]+(\[[^\]]*\])?", r).group(0).split("[")[0].lower(): r for r in every}


def install_commands(text: str) -> list[list[str]]:
    """The `pip install ...` commands in a line of text: ["install", arg, ...] each, quotes removed."""
    commands = []
    for found in re.finditer(r"\bpip install\b", text):
        args, rest = ["install"], text[found.end() :]
        while m := _ARG.match(rest):
            word = m.group(1)
            bare = word.strip("'\"")
            if not (
                bare.startswith(("-", ".", "dist/"))
                or word[0] in "'\""
                or re.match(r"^[A-Za-z][\w\-]*(\[[\w,]+\])?([<>=!~].*)?$", bare)
            ):
                break
            if bare in ("or", "and", "from", "with", "then", "for", "the", "in", "on", "to", "pulls", "once"):
                break
            args.append(bare)
            rest = rest[m.end() :]
        commands.append(args)
    return commands


def problems(command: list[str], line: str) -> list[str]:
    """Why `command` (found on `line`) is not one of the accepted forms; [] when it is."""
    project = pyproject()["project"]
    extras = set(project["optional-dependencies"])
    requirements = _requirements()
    found, wanted = [], [a for a in command[1:] if a not in OPTIONS]
    if not wanted:
        return [f"installs nothing: {shlex.join(command)}"]
    for arg in wanted:
        tree = re.fullmatch(r"\.(?:\[([\w,]+)\])?", arg)
        wheel = re.fullmatch(r"dist/burst_attention-([^-]+)-py3-none-any\.whl(?:\[([\w,]+)\])?", arg)
        named = re.fullmatch(r"([A-Za-z][\w\-]*)(?:\[([\w,]+)\])?(.*)", arg)
        if tree or wheel:
            asked = set(((tree or wheel).group(1 if tree else 2) or "").split(",")) - {""}
            if asked - extras:
                found.append(f"{arg}: no such extra {sorted(asked - extras)} (pyproject.toml has {sorted(extras)})")
            if wheel and wheel.group(1) != project["version"]:
                found.append(f"{arg}: the tree builds version {project['version']}")
        elif named and named.group(1).lower() == "burst-attention":
            if not re.search(r"publish", line, re.I):
                found.append(
                    f"{arg}: burst-attention is not on the package index; this form only on a line "
                    "that says it is the published one (docs/install.md)"
                )
        elif named and named.group(1).lower() in FLASH_ATTN:
            if named.group(3) not in ("", FLASH_ATTN_SPEC):
                found.append(f"{arg}: burst drives flash-attn {FLASH_ATTN_SPEC}")
        elif named and named.group(1).lower() in requirements:
            if arg != requirements[named.group(1).lower()]:
                found.append(f"{arg}: pyproject.toml asks for {requirements[named.group(1).lower()]!r}")
        else:
            found.append(f"{arg}: not a form docs/install.md gives")
    return found


def _filled(path: Path, text: str) -> str:
    """A .py file's text with the f-string constants its install messages name filled in."""
    for name, value in re.findall(r"^([A-Z_]+) = \"([^\"]*)\"", text, re.M):
        text = text.replace("{" + name + "}", value)
    if "{TESTED_TRANSFORMERS}" in text:
        source = (ROOT / "burst/integrations/transformers/backend/attention.py").read_text()
        text = text.replace(
            "{TESTED_TRANSFORMERS}", re.search(r'^TESTED_TRANSFORMERS = "([^"]*)"', source, re.M).group(1)
        )
    # a message split over adjacent string literals, read as the one line it prints
    return re.sub(r"""["']\s*\n\s*f?["']""", "", text)


def _files() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    code = [p for folder in ("burst", "examples") for p in sorted((ROOT / folder).rglob("*.py"))]
    return pages + code + sorted((ROOT / "scripts").glob("*.sh"))


def all_install_commands() -> list[tuple[list[str], str, str]]:
    """(command, where, line) for every `pip install` a user reads."""
    found = []
    for path in _files():
        text = path.read_text()
        if path.suffix == ".py":
            text = _filled(path, text)
        for number, line in enumerate(text.splitlines(), 1):
            for command in install_commands(line):
                found.append((command, f"{path.relative_to(ROOT)}:{number}", line.strip()))
    return found


def test_every_install_line_is_an_accepted_form():
    found = all_install_commands()
    assert len(found) >= 8, found  # README, docs/install.md, the messages: the reader found them
    offenders = [
        f"{where}: {problem}\n    {line}"
        for command, where, line in found
        for problem in problems(command, line)
        if not where.startswith("scripts/")
    ]  # scripts install into .venv with their own pins
    assert not offenders, "install lines that do not work as written:\n" + "\n".join(offenders)


def test_the_reader_catches_what_fails():
    """The forms that failed before issue 69, and look-alikes, are caught."""
    for line in (
        "pip install 'burst-attention[hf]'",
        "pip install '.[hfx]'",
        "pip install 'transformers>=5.0' 'accelerate>=1.1'",
        "pip install 'dist/burst_attention-0.0.1-py3-none-any.whl[hf]'",
        "pip install " + "burst",
        "pip install 'flash-attn>=2.5'",
    ):
        (command,) = install_commands(line)
        assert problems(command, line), line
    for line in (
        "pip install .",
        "pip install -e '.[dev,hf,plot]'",
        "pip install matplotlib",
        "pip install 'flash-attn>=2.7' --no-build-isolation",
        "the published form, once published: pip install 'burst-attention[hf]'",
    ):
        (command,) = install_commands(line)
        assert not problems(command, line), (line, problems(command, line))


def test_extras_table_is_pyproject():
    """docs/install.md's one table of extras names each extra and brings what pyproject.toml lists."""
    text = (ROOT / "docs" / "install.md").read_text()
    for extra, requirements in pyproject()["project"]["optional-dependencies"].items():
        row = re.search(rf"^\| `{re.escape(extra)}` \| ([^|]*) \|", text, re.M)
        assert row, f"docs/install.md's extras table has no row for {extra}"
        listed = re.findall(r"`([^`]+)`", row.group(1))
        assert listed == requirements, f"{extra}: the table says {listed}, pyproject.toml {requirements}"
    assert f"flash-attn>={FLASH_ATTN_SPEC[2:]}" in text and "2.7 or newer" in text


def test_flash_attn_version_is_the_one_burst_drives():
    source = (ROOT / "burst" / "kernels" / "cuda_flash_attn.py").read_text()
    assert re.search(r"2\.7", source), "cuda_flash_attn.py no longer names 2.7: update FLASH_ATTN_SPEC and the docs"
