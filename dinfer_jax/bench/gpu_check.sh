#!/usr/bin/env bash
# The GPU check (one H200, under 8 minutes): LLaDA-MoE-7B-A1B shape, random bf16 weights, gen_length 1024,
# block 64, dual cache, batch 1 and 8, fixed_steps at k = 1 and 4 tokens per forward.
#   pip install -e .[cuda12]
#   dinfer_jax/bench/gpu_check.sh [OUT_JSON] [extra flags for python -m dinfer_jax.bench.gpu_check]
# Prints a markdown table and writes the JSON (default gpu_check.json). Configs not started within
# --budget-s (400 s) are skipped and listed, so the whole check stays under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-gpu_check.json}"
shift || true
python -c "import jax; print('devices:', jax.devices())"
timeout 470 python -m dinfer_jax.bench.gpu_check --json "$out" "$@"
