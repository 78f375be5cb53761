#!/usr/bin/env bash
# The GPU check, on the GPU machine's own stack (its python3, jax 0.11 + CUDA 13 plugin): no pip install of
# the project, no registry. Runs from the checkout with PYTHONPATH; the wheels gpu_prep.sh put in .whl/ are
# installed into a scratch folder first (only those the machine lacks).
#   dinfer_jax/bench/gpu_check.sh [OUT_DIR] [flags for python -m dinfer_jax.bench.gpu_check]
# Writes OUT_DIR/gpu_check.json and gpu_check.md (default $OUT or ./gpu_check_out) and prints the table.
# About 6 minutes on an H200, compiles included; items that no longer fit the --budget-s (330 s) are skipped
# and listed. A rerun in the same machine session reuses the persistent compilation cache.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
out="${1:-${OUT:-gpu_check_out}}"
shift || true
SITE="${DINFER_JAX_SITE:-/tmp/dinfer_jax_site}"
if [ -d .whl ]; then
  "$PY" dinfer_jax/bench/box_install.py .whl "$SITE"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
case " $* " in
  *" --tiny "*) ;;  # the CPU rehearsal (tests/bench): same script, the tiny preset on any device
  *) "$PY" -c "import jax, jaxlib; d = jax.devices(); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, d); \
assert jax.default_backend() == 'gpu', 'JAX sees no GPU: ' + str(d)" ;;
esac
timeout 380 "$PY" -m dinfer_jax.bench.gpu_check --out "$out" "$@"
