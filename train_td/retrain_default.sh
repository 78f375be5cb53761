#!/usr/bin/env bash
# Retrains the embedded default model (dinfer_jax/assets/default) in one command: the from-scratch run
# (default_v7) and the five fine-tunes that made default_v14, then the export. Every stage resumes: run the
# command again after an interruption and a finished stage is restored at its last step, not retrained.
# train_td/README.md ("The shipped model") has what each stage adds and its wall time.
#
#   bash train_td/retrain_default.sh WORK_DIR [OUT_DIR]
#
# OUT_DIR defaults to dinfer_jax/assets/default (replaced: the export runs with --overwrite). PYTHON picks
# the interpreter (default: python).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: bash train_td/retrain_default.sh WORK_DIR [OUT_DIR]" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1"
WORK=$(cd "$1" && pwd)
OUT=${2:-$REPO/dinfer_jax/assets/default}
PY=${PYTHON:-python}
# Resuming compares the flags with the run's saved config, --init-from included: absolute paths keep a rerun
# from another directory the same run.
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

# The three tasks on one canvas of 8 (47 minutes on an idle 2-core machine).
"$PY" -m train_td train "$WORK/default_v7" --steps 4200 --batch-size 128 --lr 3e-3 --warmup-steps 150 \
    --max-position 128 --mix arithmetic=0.54,program=0.30,add=0.16 --ckpt-every 250 --log-every 20 --seed 0
# split (many right answers), answers EOS-padded to canvases of 8-64, answers masked from a random cut.
"$PY" -m train_td train "$WORK/ft_v10" --init-from "$WORK/default_v7" --max-position 128 --steps 800 \
    --batch-size 128 --lr 1e-3 --warmup-steps 50 --mix arithmetic=0.25,program=0.2,add=0.15,split=0.4 \
    --canvases 8=0.65,16=0.1,32=0.15,64=0.1 --block-mask-prob 0.2 --ckpt-every 100 --log-every 20 --seed 0
# The long canvases weighted up at falling learning rates, arithmetic and program kept in the mix: gen_length
# 64 answers as 8 does without losing accuracy at the shipped settings.
"$PY" -m train_td train "$WORK/ft_v11" --init-from "$WORK/ft_v10" --max-position 128 --steps 400 \
    --batch-size 128 --lr 3e-4 --warmup-steps 20 --mix arithmetic=0.4,program=0.25,add=0.15,split=0.2 \
    --canvases 8=0.45,16=0.1,32=0.15,64=0.3 --block-mask-prob 0.2 --ckpt-every 100 --log-every 20 --seed 2
"$PY" -m train_td train "$WORK/ft_v12" --init-from "$WORK/ft_v11" --max-position 128 --steps 300 \
    --batch-size 128 --lr 2e-4 --warmup-steps 20 --mix arithmetic=0.45,program=0.25,add=0.1,split=0.2 \
    --canvases 8=0.35,16=0.1,32=0.15,64=0.4 --block-mask-prob 0.2 --ckpt-every 100 --log-every 20 --seed 3
"$PY" -m train_td train "$WORK/ft_v13" --init-from "$WORK/ft_v12" --max-position 128 --steps 300 \
    --batch-size 128 --lr 1.5e-4 --warmup-steps 20 --mix arithmetic=0.35,program=0.4,add=0.05,split=0.2 \
    --canvases 8=0.3,16=0.1,32=0.15,64=0.45 --block-mask-prob 0.2 --ckpt-every 100 --log-every 20 --seed 4
# Every block cut drawn within the task's own region (the block a short answer is decoded in) however long
# the canvas, on 60% of rows: the state of a short answer's first forward on a 64-position canvas (all of it
# masked), which a cut anywhere in 64 positions gave one row in eight. Program answers at 64 as at 8.
"$PY" -m train_td train "$WORK/ft_v14" --init-from "$WORK/ft_v13" --max-position 128 --steps 400 \
    --batch-size 128 --lr 1.5e-4 --warmup-steps 20 --mix arithmetic=0.3,program=0.5,add=0.05,split=0.15 \
    --canvases 8=0.3,16=0.1,32=0.1,64=0.5 --block-mask-prob 0.6 --block-cut-span task --ckpt-every 100 \
    --log-every 20 --seed 5
"$PY" -m train_td export "$WORK/ft_v14" --out "$OUT" --overwrite
