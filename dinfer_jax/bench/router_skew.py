"""How unevenly a trained router spreads tokens over its experts, measured on a checkpoint.

Per MoE layer: the share of routed rows each expert gets over a set of prompts, and the coefficient of
variation of those shares across experts less the part sampling alone gives (rows picking experts at random
from the shares spread a finite count by sqrt(share / rows)). The realistic GPU model
(bench.realistic.ROUTER_SKEW) takes the embedded default model's figure as the slow end of its range: the
grouped GEMM re-reads the weights of an expert with more rows than its tile.

    python -m dinfer_jax.bench.router_skew [--model default] [--prompts 64]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import api, cli_common, cli_help, tasks
from dinfer_jax.model import moe, transformer


def routed_experts(params, cfg, tokens: jax.Array, valid: jax.Array) -> list[jax.Array]:
  """Every MoE layer's expert ids [B * T, k] for one forward of tokens [B, T] (valid [B, T]: the keys attended
  to), in layer order: the forward is traced with moe.route wrapped to hand back what it picked (jit this)."""
  seen: list[jax.Array] = []
  route = moe.route

  def recorded(*args, **kw):
    w, idx = route(*args, **kw)
    seen.append(idx)
    return w, idx

  with mock.patch.object(moe, "route", recorded):
    transformer.forward(params, cfg, tokens, mask=valid, moe_impl="dense")
  return seen


def skew(counts: np.ndarray) -> dict[str, float]:
  """counts [E]: rows routed to each expert. The coefficient of variation of the shares, observed and less
  the multinomial sampling spread (E / rows (1 - 1/E) of its square), and the largest share over the mean."""
  counts = np.asarray(counts, np.float64)
  E, n = counts.size, counts.sum()
  if n <= 0:
    raise ValueError("router_skew: no routed rows")
  p = counts / n
  observed = float(p.std() / p.mean())
  sampling = E / n * (1 - 1 / E)
  return {"cv_observed": observed, "cv": float(np.sqrt(max(observed ** 2 - sampling, 0.0))),
          "max_over_mean": float(p.max() / p.mean()), "rows": float(n)}


def measure(model: api.Model, prompts: list[str], gen_tokens: int = 16) -> dict[str, Any]:
  """Routes each prompt's tokens plus gen_tokens masks (a block being decoded) through the model, in one
  batch, and reports skew() per MoE layer and their mean cv."""
  cfg = model.config
  if not cfg.n_moe_layers:
    raise ValueError(f"router_skew: the model at {model.path} has no MoE layers")
  rows = [row + [cfg.mask_token_id] * gen_tokens for row in cli_common.encode_prompts(model, prompts, warn=False)]
  # One batch, right-padded; the pads are masked out of attention and their routes dropped.
  T = max(len(r) for r in rows)
  tokens = np.full((len(rows), T), cfg.pad_token_id or 0, np.int32)
  valid = np.zeros((len(rows), T), bool)
  for b, r in enumerate(rows):
    tokens[b, :len(r)], valid[b, :len(r)] = r, True
  n = cfg.n_moe_layers
  seen = jax.jit(routed_experts, static_argnums=1)(model.params, cfg, jnp.asarray(tokens), jnp.asarray(valid))
  if len(seen) != n:
    raise RuntimeError(f"router_skew: recorded {len(seen)} routings for {n} MoE layers")
  keep = valid.reshape(-1)
  layers = [skew(np.bincount(np.asarray(idx)[keep].ravel(), minlength=cfg.n_experts)) for idx in seen]
  return {"layers": layers, "cv": float(np.mean([x["cv"] for x in layers])), "prompts": len(rows),
          "experts": cfg.n_experts, "top_k": cfg.n_experts_per_tok}


def task_prompts(model: api.Model, n: int, seed: int = 0) -> list[str]:
  """n prompts drawn in turn from the tasks the model was trained on (generation_config's trained_tasks)."""
  names = [t for t in (cli_common.trained_tasks(model) or []) if t in tasks.task_names()]
  if not names:
    raise ValueError(f"router_skew: the model at {model.path} lists no trained tasks this build knows; "
                     "pass prompts with --prompt")
  per = -(-n // len(names))
  drawn = [tasks.test_problems(name, per, seed) for name in names]
  return [drawn[i % len(names)][i // len(names)].prompt for i in range(n)]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  ap.add_argument("--model", default="default", help="a checkpoint directory, or default (the embedded model)")
  ap.add_argument("--prompts", type=int, default=64, help="prompts drawn from the model's trained tasks")
  ap.add_argument("--prompt", action="append", default=None, help="a prompt of your own (repeatable)")
  ap.add_argument("--json", dest="json_out", default=None)
  args = ap.parse_args(argv)
  model = api.load(args.model)
  prompts = args.prompt or task_prompts(model, args.prompts)
  res = measure(model, prompts)
  for i, x in enumerate(res["layers"]):
    print(f"MoE layer {i}: cv {x['cv']:.3f} (observed {x['cv_observed']:.3f}), largest share "
          f"{x['max_over_mean']:.2f}x the mean, {x['rows']:.0f} rows")
  print(f"cv: {res['cv']:.3f} over {res['prompts']} prompts ({res['experts']} experts, top-{res['top_k']})")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(res, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
