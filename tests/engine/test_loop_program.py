"""What the generate program traces, not only what it returns: dead work behind a runtime select survives
XLA (it cannot prove the select's predicate), so it must not be traced at all."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from dinfer_jax.bench import presets
from dinfer_jax.engine import generate as gen_lib
from dinfer_jax.engine import iteration
from dinfer_jax.engine import loop
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import engine_params
from dinfer_jax.engine.program import Knobs
from dinfer_jax.model.params import init_params


def _subjaxprs(eqn):
  for p in eqn.params.values():
    for sub in (p if isinstance(p, (list, tuple)) else [p]):
      if isinstance(sub, jcore.ClosedJaxpr):
        yield sub.jaxpr
      elif isinstance(sub, jcore.Jaxpr):
        yield sub


def _dots_over(jaxpr, rows_vocab: tuple[int, int]) -> int:
  """dot_generals anywhere under `jaxpr` with a [..., rows, V] operand."""
  n = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      n += any(tuple(v.aval.shape[-2:]) == rows_vocab for v in e.invars)
    n += sum(_dots_over(s, rows_vocab) for s in _subjaxprs(e))
  return n


def _smoothing_program():
  cfg = presets.get("tiny").model()
  # 5 blocks: the generation's 80 rows are neither the window's 48 nor the model's 64 features.
  gcfg = GenerationConfig(gen_length=80, block_length=16, cache="dual", threshold=0.8, prompt_bucket=16,
                          cont_weight=0.3, prefix_look=16, after_look=16, warmup_steps=4)
  lay, prog = gen_lib.prepare(cfg, [list(range(10, 26))], gcfg)
  params = jax.eval_shape(lambda: engine_params(init_params(cfg, jax.random.PRNGKey(0)), cfg))
  args = (jnp.asarray(lay.canvas), jnp.asarray(lay.valid), jnp.asarray(lay.positions), jax.random.PRNGKey(0),
          Knobs.of(gcfg))
  return cfg, lay, jax.make_jaxpr(lambda p, *a: loop.run(prog, p, *a))(params, *args).jaxpr


def _conds_outside_loops(jaxpr):
  """The cond/switch equations under `jaxpr`, not inside its while loops."""
  for e in jaxpr.eqns:
    if e.primitive.name == "cond":
      yield e
    if e.primitive.name != "while":
      for s in _subjaxprs(e):
        yield from _conds_outside_loops(s)


def test_refresh_takes_the_rows_from_the_block_on():
  """With smoothing the block entry's LM head and soft embedding take the block and the rows after it, in the
  narrowest of the bucketed widths that holds them (80 rows of 5 blocks: 80, 48, 32, 16), not the whole
  generation at every block: the rows before hold no mask. Exactness: the golden traces with smoothing."""
  cfg, lay, jx = _smoothing_program()
  G = lay.grid.canvas_len - lay.grid.first_block
  widths = iteration.tail_widths(G, 16)
  assert widths == (80, 48, 32, 16)
  assert iteration.block_shares(widths, G, 16) == (0.4, 0.2, 0.2, 0.2)  # blocks 0-1, 2, 3, 4
  body = [e for e in jx.eqns if e.primitive.name == "while"][0].params["body_jaxpr"].jaxpr
  tails = [e for e in _conds_outside_loops(body) if len(e.params["branches"]) == len(widths)]
  assert len(tails) == 1
  for i, br in enumerate(tails[0].params["branches"]):
    # Its soft embedding takes [w, V] probabilities, and no branch a wider one.
    assert [_dots_over(br.jaxpr, (w, cfg.vocab_size)) >= 1 for w in widths] == [j == i for j in range(4)]


def test_cached_steps_do_not_soft_embed_the_whole_canvas():
  """Dual cache + iteration smoothing (dInfer's setting): the refresh iteration soft-embeds the generation
  region ([B, Tc - C, V] probabilities x [V, D] table: the prompt holds no mask); the cached steps only their
  window. Before engine.loop traced what its fixed branch can produce, every cached step also soft-embedded
  the zero full logits (at 7B-A1B an 0.8 TFLOP GEMM per step, ~1 ms on an H200, that XLA kept)."""
  cfg, lay, jx = _smoothing_program()
  canvas = (lay.grid.canvas_len - lay.grid.first_block, cfg.vocab_size)
  assert len({lay.grid.window, canvas[0], cfg.d_model}) == 3  # a window's product cannot pass for the canvas's
  blocks = [e for e in jx.eqns if e.primitive.name == "while"]
  assert len(blocks) == 1
  body = blocks[0].params["body_jaxpr"].jaxpr
  steps = [e for e in body.eqns if e.primitive.name == "while"]
  # The last loop of the block body runs the cached steps (the first, with vicinity, the warm-up steps that
  # pick their forward at run time and may need the canvas's).
  whole = (lay.grid.canvas_len, cfg.vocab_size)
  assert steps and [_dots_over(steps[-1].params["body_jaxpr"].jaxpr, rows) for rows in (canvas, whole)] == [0, 0]
  assert _dots_over(body, canvas) >= 1  # the refresh's soft embedding: the check sees such a product
  assert _dots_over(jx, whole) == 0  # none over the prompt's rows
