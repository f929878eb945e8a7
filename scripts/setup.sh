#!/usr/bin/env bash
# Creates .venv beside the repo and installs burst into it (idempotent).
# torch is pinned to 2.13.0 only when no torch is present: on our machines that takes the local CPU
# wheel, while a looser request would pull several GB of CUDA packages. pyproject keeps torch>=2.4.
# burst is (re)installed with its dev, hf and plot extras whenever pyproject.toml differs from the one
# last installed, so a new dependency or extra reaches an existing .venv too.
# --no-compile: pip would byte-compile every module of every package (~80 s of the ~140 s a fresh
# set-up took on 2 cores). The set-up compiles what every run imports (warm_bytecode); the rest is
# compiled when first imported, and cached unless PYTHONDONTWRITEBYTECODE is set (scripts/test.sh unsets it).
set -euo pipefail

warm_bytecode() {
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "import burst.cli, burst.engine, torch._dynamo, transformers.modeling_utils, burst.integrations.transformers, transformers.models.llama.modeling_llama"
}

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q --no-compile torch==2.13.0
fi
stamp=.venv/.burst-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import burst, pytest" >/dev/null 2>&1; then
  # the distribution was called "burst" before it became burst-attention ("burst" on PyPI is another
  # project, which would shadow `import burst` too): a .venv holding either loses it first
  if .venv/bin/pip show -q burst >/dev/null 2>&1; then
    .venv/bin/pip uninstall -q -y burst
  fi
  .venv/bin/pip install -q --no-compile -e ".[dev,hf,plot]"
  warm_bytecode
  echo "$want" > "$stamp"
fi
