#!/usr/bin/env bash
# The transformers tests on the lowest transformers release of the `hf` extra's range in pyproject.toml.
# That release goes into .venv/lowest-transformers/ (its dependencies are .venv's own, which its
# import-time version check accepts) and shadows .venv's newer one through PYTHONPATH.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
lowest=$(sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
if [ -z "$lowest" ]; then
  echo "pyproject.toml names no transformers>=X lower bound" >&2
  exit 1
fi
target=.venv/lowest-transformers/$lowest
if [ ! -f "$target/.installed" ]; then
  rm -rf "$target"
  .venv/bin/pip install -q --no-compile --no-deps --target "$target" "transformers==$lowest"
  touch "$target/.installed"
fi
export PYTHONPATH="$root/$target${PYTHONPATH:+:$PYTHONPATH}"
got=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
if [ "$got" != "$lowest" ]; then
  echo "expected transformers $lowest on PYTHONPATH, imported $got" >&2
  exit 1
fi
echo "transformers tests on the lowest tested release, transformers $lowest:"
# The zoo (every family's forward at 1 and 2 ranks: the attention interface, keywords, sinks, hybrids' mixers),
# the hybrids' training step (their mixers' signatures change between releases) and generate() on a
# ShardedCache (the Cache API), and the generate example as a user runs it (generate()'s cache keyword: `cache`
# from 5.24 on, `past_key_values` on this release).
OMP_NUM_THREADS=1 exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests/test_hf_zoo.py tests/test_hf_hybrid.py \
  "tests/test_transformers_generate.py::test_greedy_and_sampled_tokens_equal_one_process_generate[2]" \
  tests/test_transformers_generate.py::test_torchrun_example_generates_like_one_process
