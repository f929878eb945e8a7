#!/usr/bin/env bash
# scripts/gpu_train_lengths.sh OUT [--budget 530] [--profile H100|H200] [--modes full,selective,remat,none] [--no-hf] [--no-speed]
#                                  [--gpu-mem-gib 80] [--no-oom-check] [--dry-run]
# llama3-8b on this machine's one GPU (issue 70): the longest sequence one training step completes per
# checkpointing mode (host optimizer; the planner picks 2-3 lengths), tokens/s and MFU at 32K and 128K,
# and transformers' LlamaForCausalLM (sdpa, gradient checkpointing, bf16) beside it; peak GPU and host
# memory per trial. Writes OUT/report.md, OUT/results.json, OUT/trial-NN.log; stops itself within
# --budget seconds (default 530; a hard stop at BURST_TRAIN_LENGTHS_TIMEOUT, default 590).
# --dry-run lists the trials with their expected seconds. --cpu: a tiny model at tiny lengths (the test).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: scripts/gpu_train_lengths.sh OUT [--budget SECONDS] [--profile H100|H200]}
shift
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
timeout --kill-after=10 "${BURST_TRAIN_LENGTHS_TIMEOUT:-590}" "$python" -u "$root/scripts/gpu_train_lengths.py" "$out" "$@" 2>&1 \
  | tee "$out/log.txt"
