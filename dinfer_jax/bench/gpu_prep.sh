#!/usr/bin/env bash
# Prepares, on a CPU machine with the package registry, what the GPU machine lacks: wheels for its Python
# (3.12, x86-64 manylinux) in the git-ignored folder .whl/ at the repo root. The GPU machine brings its own
# jax 0.11 + CUDA 13 plugin, flax, optax, orbax, chex, transformers, numpy; it lacks tokamax (the MoE grouped
# GEMM; without it every MoE call above 128 tokens runs the dense kernel, 8x the refresh FLOPs) and what
# tokamax needs beyond that. gpu_check.sh installs, from .whl/ and without a registry, only the ones the
# machine does not already have.
#   dinfer_jax/bench/gpu_prep.sh            # then: run the check with `carry: [".whl"]` (about 3.3 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
rm -rf .whl.tmp && mkdir -p .whl.tmp
# tokamax's own requirements and theirs, one version each (pydantic-core is binary: built for cp312).
PKGS=(tokamax==0.0.12 qwix==0.1.8 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 typeguard==2.13.3
      immutabledict==4.3.1 tensorboardx==2.6.5 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 absl-py==2.5.1)
for p in "${PKGS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl.tmp "$p" 2>&1 | grep -v "^WARNING: Location" || true
done
n=$(ls .whl.tmp/*.whl | wc -l)
if [ "$n" -ne "${#PKGS[@]}" ]; then
  echo "gpu_prep: expected ${#PKGS[@]} wheels, got $n in .whl.tmp" >&2
  exit 1
fi
rm -rf .whl && mv .whl.tmp .whl
du -sh .whl
