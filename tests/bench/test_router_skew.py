"""The router-skew measurement (bench.router_skew) by hand and on the embedded default model."""
from __future__ import annotations

import numpy as np
import pytest

from dinfer_jax import api, cli_common
from dinfer_jax.bench import router_skew


def test_skew_by_hand():
  # Shares 3/4 and 1/4: the shares' coefficient of variation is 0.25 / 0.5; 40 rows drawn at random from
  # equal shares would spread them by 2 / 40 x (1 - 1/2) of its square.
  s = router_skew.skew(np.array([30, 10]))
  assert s["cv_observed"] == pytest.approx(0.5)
  assert s["cv"] == pytest.approx(np.sqrt(0.25 - 0.025))
  assert s["max_over_mean"] == pytest.approx(1.5) and s["rows"] == 40
  assert router_skew.skew(np.array([5, 5, 5, 5]))["cv"] == 0.0
  with pytest.raises(ValueError, match="no routed rows"):
    router_skew.skew(np.zeros(4))


def test_the_default_models_router_is_skewed():
  """Every MoE layer routes each prompt's tokens and the block's masks, k rows each; the trained router
  spreads them far less evenly than sampling would (bench.realistic.ROUTER_SKEW is this figure at 64
  prompts)."""
  model = api.load()
  prompts = router_skew.task_prompts(model, 8)
  assert len(prompts) == 8 and len(set(prompts)) == 8
  res = router_skew.measure(model, prompts, gen_tokens=16)
  cfg = model.config
  assert len(res["layers"]) == cfg.n_moe_layers
  tokens = sum(len(ids) + 16 for ids in cli_common.encode_prompts(model, prompts, warn=False))
  assert all(x["rows"] == tokens * cfg.n_experts_per_tok for x in res["layers"])
  assert all(0.3 < x["cv"] < 1.5 and x["cv"] <= x["cv_observed"] for x in res["layers"])
