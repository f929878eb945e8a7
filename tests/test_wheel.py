"""What a user who installs burst has, not the work tree (issue 60, item 1).

The distribution is `burst-attention` ("burst" on PyPI is an unrelated project); the import and the
command stay `burst`. The test copies the repository's files (git's tracked ones and the untracked
ones it does not ignore, as a commit of the work tree would hold them) into a temporary folder,
builds the wheel offline, and installs it alone into a new virtual environment that sees this
environment's site-packages (torch, transformers) through a plain path entry but not its editable
burst. From outside the repository it then runs `burst --help`, imports burst and its transformers
backend from the new environment, and runs one small `burst bench` row.

Without an extra, each path that needs it says which install brings it, in one line: `burst plan
--hf-config` and the transformers backend's lazily imported classes, with transformers blocked.

Nothing is skipped: a missing git, setuptools (the dev extra's) or extra fails the test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "burst-attention"
TIMEOUT = 300


def _env() -> dict:
    """This environment less whatever would put the work tree or user packages on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", BURST_DEBUG="0")
    return env


def _run(cmd, cwd, check=True):
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    if check:
        assert done.returncode == 0, (
            f"{' '.join(map(str, cmd))} exited {done.returncode}\n"
            f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
        )
    return done


def _repo_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(tmp, the new environment's python, its site-packages, the wheel) with only the wheel's burst."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in _repo_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    assert not any(src.glob("*.egg-info")), "the copy holds build leftovers"

    # the wheel, offline: this environment's setuptools (the dev extra) is the build backend
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            src,
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            tmp / "dist",
        ],
        cwd=tmp,
    )
    wheels = sorted((tmp / "dist").glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["burst_attention"], wheels

    # a new environment; this one's site-packages as a plain path entry: a path added by a .pth file
    # is not a site dir, so its own .pth files (the editable burst's finder) are never processed
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp).stdout.strip())
    host = Path(sysconfig.get_path("purelib"))
    assert (host / "torch").is_dir(), f"torch is not in {host}"
    (site / "_burst_test_host_site.pth").write_text(f"{host}\n")

    # torch found (not imported: the imports below show it loads), burst not
    before = _run(
        [python, "-c", "import importlib.util; assert importlib.util.find_spec('torch'); import burst"], tmp, False
    )
    assert before.returncode != 0 and "No module named 'burst'" in before.stderr, (
        f"burst is importable in the new environment before the wheel is installed:\n{before.stderr[-2000:]}"
    )

    # --ignore-installed: the host's editable burst-attention is seen, and must be left alone
    _run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--no-compile", wheels[0]],
        cwd=tmp,
    )
    return tmp, python, site, wheels[0]


def test_wheel_metadata(installed):
    tmp, python, site, wheel = installed
    infos = list(site.glob("burst_attention-*.dist-info"))
    assert len(infos) == 1, infos
    metadata = (infos[0] / "METADATA").read_text()
    assert f"Name: {DIST}\n" in metadata
    assert "Requires-Dist: torch>=2.4\n" in metadata  # loose: a user's own torch build is kept
    assert re.search(r"^burst = burst\.cli:main$", (infos[0] / "entry_points.txt").read_text(), re.M)
    top = (infos[0] / "top_level.txt").read_text().split() if (infos[0] / "top_level.txt").exists() else ["burst"]
    assert top == ["burst"]
    assert (site / "burst" / "cli" / "__init__.py").is_file()
    assert (site / "burst" / "integrations" / "transformers" / "backend" / "attention.py").is_file()


def test_installed_command_import_and_bench(installed):
    tmp, python, site, wheel = installed
    command = python.parent / "burst"
    assert command.is_file(), "the wheel installed no `burst` command"
    # the command runs a verb (bench, below); its --help's listing is test_cli's test_version_and_help

    where = _run([python, "-c", "import burst, burst.integrations.transformers; print(burst.__file__)"], cwd=tmp)
    found = Path(where.stdout.strip().splitlines()[-1]).resolve()
    assert found.is_relative_to(site.resolve()), f"burst imported from {found}, not {site}"
    assert not found.is_relative_to(ROOT), f"burst imported from the work tree: {found}"

    bench = _run(
        [
            command,
            "bench",
            "--seq-len",
            "256",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--nproc",
            "2",
            "--strategies",
            "burst",
            "--repeats",
            "1",
            "--threads",
            "1",
        ],
        cwd=tmp,
    )
    assert re.search(r"^\| burst \|", bench.stdout, re.M), bench.stdout


BLOCK_TRANSFORMERS = "import sys; sys.modules['transformers'] = None; sys.modules['accelerate'] = None; "


def test_missing_hf_extra_is_one_line(tmp_path):
    """One process with transformers blocked: the library's paths (register() and the classes that subclass
    transformers' own) print their ImportError, then `burst plan --hf-config` refuses in one line."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    probe = BLOCK_TRANSFORMERS + (
        "import burst.integrations.transformers as bt\n"
        "for use in (bt.register, lambda: bt.SequenceParallelTrainer, lambda: bt.ShardedCache):\n"
        "    try:\n"
        "        use()\n"
        "    except ImportError as err:\n"
        "        print(err)\n"
        "    else:\n"
        "        print('no error')\n"
        "sys.stdout.flush()\n"
        "from burst.cli import main\n"
        "sys.exit(main())\n"
    )
    done = _run(
        [sys.executable, "-c", probe, "plan", "--gpus", "8", "--seq-len", "4096", "--hf-config", config],
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "burst plan: error: --hf-config: needs transformers: pip install 'transformers>=5.23.0,<6' (or, from a "
        "clone of burst, pip install '.[hf]')"
    ]
    lines = done.stdout.splitlines()
    assert len(lines) == 3, lines
    from test_install_lines import install_commands, problems

    for line in lines:  # each names an install that works as written (tests/test_install_lines.py's forms)
        commands = install_commands(line)
        assert commands and not [p for c in commands for p in problems(c, line)], line


def test_install_lines_name_the_distribution():
    """Every install line in the repository names burst-attention, never PyPI's unrelated burst."""
    old = re.compile(r"(?<![-\w/.])burst\[\w[\w,]*\]|pip install\s+['\"]?burst(?![-\w])")
    offenders = []
    for name in _repo_files():
        path = ROOT / name
        if (
            path.suffix not in (".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".txt", ".cfg")
            or path == Path(__file__).resolve()
        ):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if old.search(line):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert not offenders, "install lines that name PyPI's unrelated 'burst':\n" + "\n".join(offenders)


def test_install_lines_from_the_tree_run(installed):
    """The install lines of README, docs/ and burst's messages that install from the tree: the plain
    one runs as written (with pip's offline flags: --no-deps, --no-index, --no-build-isolation) from
    a copy of the clone into a new environment; the editable one is scripts/setup.sh's, which every
    fresh clone runs. The wheel they name is the one the tree builds."""
    from test_install_lines import all_install_commands

    tmp, python, site, wheel = installed
    commands = {tuple(c) for c, _, _ in all_install_commands()}
    tree = sorted(c for c in commands if "-e" not in c and any(a == "." or a.startswith(".[") for a in c))
    wheels = sorted({a for c in commands for a in c if ".whl" in a})
    assert tree and wheels, (tree, wheels)
    for name in wheels:  # the wheel a page names is the one `pip wheel` builds from this tree
        assert Path(name.split("[")[0]).name == wheel.name, f"a page names {name}; the tree builds {wheel.name}"
    command = max(tree, key=len)  # the one with the most extras: '.[hf]'
    venv = tmp / "venv-tree"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp).stdout.strip())
    (purelib / "_burst_test_host_site.pth").write_text(f"{sysconfig.get_path('purelib')}\n")
    _run(
        [
            py,
            "-m",
            "pip",
            *command,
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--ignore-installed",
            "--no-compile",
        ],
        cwd=tmp / "src",
    )
    # where `import burst` finds it (that the installed package imports is test_installed_command_import_and_bench's)
    where = _run(
        [py, "-c", "import importlib.util; print(importlib.util.find_spec('burst').origin)"], cwd=tmp
    ).stdout.split()
    assert Path(where[-1]).resolve().is_relative_to(purelib.resolve()), (command, where)
