"""The documentation a user browses (issue 52): the README stays a short front page that opens with
the two commands, its links lead somewhere, and the mkdocs site (docs/, mkdocs.yml, the API
reference built from the docstrings) builds with --strict: no broken link or anchor, no page left
out of the nav, no docstring griffe cannot read, no documented name missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from requires import importorskip

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# The README opens with these two lines, as they are (.ci/run calls scripts/test.sh); the suite's minutes are
# benchmarks/suite_time.md's figure (test_suite_time_is_one_figure), written here as ~N.
COMMANDS = [
    (
        "bash scripts/bench.sh     # set up .venv, then `burst bench`: "
        "burst/ring/allgather on 2 local CPU processes vs one-process SDPA"
    ),
    (
        "bash scripts/test.sh      # set up .venv, then the whole test suite "
        "(multi-process gloo worlds, ~N min on 2 cores)"
    ),
]

# What each API page must document: the public names of each area, under the area's own path.
API_NAMES = {
    "api/burst": [
        "burst.attention",
        "burst.shard",
        "burst.unshard",
        "burst.CommStats",
        "burst.BlockSparseMask",
        "burst.Topology",
        "burst.check.check",
        "burst.set_agreement_check",
    ],
    "api/transformers": [
        f"burst.integrations.transformers.{name}"
        for name in (
            "register",
            "shard_batch",
            "check_model",
            "reduce_gradients",
            "reduce_loss",
            "fully_shard",
            "ShardedCache",
            "SequenceParallelTrainer",
        )
    ],
    "api/masks": ["burst.masks.BlockSparseMask", "burst.masks.MaskSpec", "burst.masks.plan_tiles"],
    "api/engine": ["burst.engine.fused_linear_cross_entropy", "burst.engine.Transformer"],
    "api/context_parallel": ["burst.context_parallel.context_parallel"],
    "api/plan": ["burst.plan.plan"],
    "api/inference": ["burst.inference.ShardedKVCache", "burst.inference.decode_attention"],
}


def test_readme_is_a_short_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move sections to docs/ (at most 200)"
    fence = lines.index("```bash")
    assert fence <= 2, "README.md must open with the commands block, right under its title"
    opening = [re.sub(r"~\d+ min", "~N min", line) for line in lines[fence + 1 : fence + 3]]
    assert opening == COMMANDS, "README.md must open with the two commands, exactly"
    assert lines[fence + 3] == "```"


def _relative_links(markdown: str) -> list[str]:
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", markdown)
    reference = re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", markdown, flags=re.M)
    return [
        link
        for link in inline + reference
        if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link) and not link.startswith("#")
    ]


def test_readme_links_point_to_files():
    links = _relative_links(README.read_text())
    assert links, "README.md links to no page"
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_mkdocs_build_strict(tmp_path):
    importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]' installs it)")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    for page, names in API_NAMES.items():
        html = (site / page / "index.html").read_text()
        missing = [name for name in names if f'id="{name}"' not in html]
        assert not missing, (
            f"{page}: the API reference does not document {missing} (a name moved, or is served "
            "lazily in a way docs/griffe_lazy_exports.py does not see)"
        )


# --- figures that name the file they come from stay in step with it (issue 69 item 5) --------------

SUITE_TIME = ROOT / "benchmarks" / "suite_time.md"


def test_suite_time_is_one_figure():
    """The suite's time is quoted from benchmarks/suite_time.md, the same in README and docs/index.md."""
    figure = re.search(r"on 2 cores: \*\*(~\d+ min)\*\*", SUITE_TIME.read_text()).group(1)
    for page in (README, ROOT / "docs" / "index.md"):
        quoted = re.findall(r"~\d+ min on 2 cores", page.read_text())
        assert quoted == [f"{figure} on 2 cores"], (
            f"{page.name} quotes {quoted}; benchmarks/suite_time.md says {figure}"
        )


def _figures(text: str) -> list[str]:
    """The figures of a claim: numbers, ranges (0.80-0.91) and exponents (4.6e-5)."""
    return re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?(?:-\d+(?:\.\d+)?)?(?![\w.])", text)


def test_gpu_status_figures_are_in_their_files():
    """README's table of what ran on a GPU: each row's figures are in the benchmark file it links."""
    lines = README.read_text().splitlines()
    start = lines.index("## What has run on a GPU, and what has not")
    assert start < 40, "the GPU status must be on the README's first screen"
    rows = [line for line in lines[start : start + 20] if line.startswith("| ") and "](benchmarks/" in line]
    assert len(rows) >= 4, rows
    for row in rows:
        claim, source = row.strip("| ").rsplit(" | ", 1)
        path = ROOT / re.search(r"\]\((benchmarks/[^)]+)\)", source).group(1)
        text = path.read_text()
        missing = [figure for figure in _figures(claim) if figure not in text]
        assert not missing, f"README's GPU claim {claim!r}: {missing} not in {path.relative_to(ROOT)}"
    never = "\n".join(lines[start : start + 30])
    for what in ("NCCL between GPUs", "several nodes", "flash_attn"):
        assert what in never.split("**Never run on a GPU**", 1)[-1], f"the README must say {what} never ran on a GPU"


def test_docs_gpu_figures_are_in_benchmarks_gpu():
    """The case counts and speed ranges docs/ quotes from benchmarks/gpu.md are there."""
    text = (ROOT / "benchmarks" / "gpu.md").read_text()
    for page in ("gpus.md", "launch.md", "index.md", "measured.md", "training.md", "troubleshooting.md"):
        body = (ROOT / "docs" / page).read_text()
        for figure in re.findall(r"\b(\d+ cases|0\.\d\d-0\.\d\d)\b", body):
            assert figure in text, f"docs/{page} quotes {figure!r}, which benchmarks/gpu.md does not hold"
    assert "Nothing has been measured on a GPU" not in (ROOT / "docs" / "measured.md").read_text()
    assert "not yet on a GPU" not in (ROOT / "docs" / "gpus.md").read_text()


def test_version_license_and_changelog_agree():
    import burst

    from test_install_lines import pyproject

    project = pyproject()["project"]
    assert burst.__version__ == project["version"], (burst.__version__, project["version"])
    top = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert top == project["version"], (
        f"CHANGELOG.md's top entry is {top}, pyproject.toml's version {project['version']}"
    )
    assert project["license"] == {"text": "Apache-2.0"}
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text


def test_help_names_every_kernel_and_the_trainable_presets():
    from burst.cli import build_parser
    from burst.kernels import kernels_by_name
    from burst.plan.models import PRESETS

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "command").choices
    helped = " ".join(verbs["check"].format_help().split())
    kernel = helped[helped.index("--kernel KERNEL") :]
    assert "auto (the fastest kernel proven for the device and dtype)" in kernel
    assert all(name in kernel for name in kernels_by_name()), kernel
    for page in ("cli.md", "gpus.md"):  # the pages that list the kernels list them all
        listings = [line for line in (ROOT / "docs" / page).read_text().split("\n\n") if "cpu_flash" in line]
        assert listings and all(name in " ".join(listings) for name in kernels_by_name()), page
    plan = " ".join(verbs["plan"].format_help().split())
    assert f"`burst train` trains {', '.join(sorted(PRESETS))}" in plan
    from burst.plan.models import model_presets

    page = " ".join((ROOT / "docs" / "checking-planning.md").read_text().split())
    papers = [name for name in model_presets() if name not in PRESETS]
    assert f"`burst train`'s ({', '.join(PRESETS)}:" in page and f"models ({', '.join(papers)}:" in page, (
        "docs/checking-planning.md names the trainable presets and the papers' ones as burst.plan.models holds them"
    )


def test_flash_attn_status_is_the_registrys():
    """README and docs say the flash_attn package is taken only when asked exactly while the kernel
    registry holds it unproven (burst/kernels/spec.py's `proven`)."""
    from burst.kernels import kernels_by_name

    proven = kernels_by_name()["flash_attn"].SPEC.proven
    pages = {"README.md": README.read_text(), "docs/launch.md": (ROOT / "docs" / "launch.md").read_text()}
    for name, text in pages.items():
        said = " ".join(text.split())
        assert ("only when asked" in said) != proven, (
            f"{name}: flash_attn is {'proven' if proven else 'unproven'} in the kernel registry; say so"
        )


def test_papers_cited_with_links():
    text = (ROOT / "docs" / "strategies.md").read_text()
    for arxiv in ("2403.09347", "2509.19836", "2310.01889", "2310.03294"):
        assert f"https://arxiv.org/abs/{arxiv}" in text, arxiv
    assert "https://doi.org/10.1109/ACCESS.2025.3544550" in text  # CQS-Attention: IEEE Access, no arXiv id


def test_the_contract_table_lists_every_accepted_keyword():
    """docs/transformers.md says the backend accepts exactly the keywords of its table: each keyword of
    bt.ACCEPTED_KEYWORDS is in it (a helper found `tokenizer` accepted and not listed)."""
    from burst.integrations.transformers.keywords import ACCEPTED_KEYWORDS

    text = (ROOT / "docs" / "transformers.md").read_text()
    table = text[text.index("## The contract") :]
    rows = " ".join(line for line in table.splitlines() if line.startswith("|"))
    listed = set(re.findall(r"`(\w+)`", rows))
    for stem in re.findall(r"`(\w+)_q/k`", rows):  # `cu_seq_lens_q/k`: both
        listed |= {f"{stem}_q", f"{stem}_k"}
    assert set(ACCEPTED_KEYWORDS) <= listed, sorted(set(ACCEPTED_KEYWORDS) - listed)
