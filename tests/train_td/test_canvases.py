"""Training on varying canvas lengths: batches whose answer region is drawn per step, and the block cut
that masks an answer from a random position onwards, as block-wise decoding leaves it."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train_td import __main__ as cli
from train_td import data as data_lib
from train_td import objective
from train_td import tokenizer as tok_lib

CANVASES = ((8, 0.4), (16, 0.2), (32, 0.2), (64, 0.2))


def _config(**kw):
  return data_lib.DataConfig(mix=(("arithmetic", 0.5), ("add", 0.5)), batch_size=64, canvases=CANVASES, **kw)


def test_canvas_batches_hold_the_same_answers_padded_with_eos():
  dc = _config()
  seen = collections.Counter()
  for s in range(60):
    task, b = data_lib.get_batch(dc, s)
    width = dc.width(task)
    B, T = b["tokens"].shape
    canvas = T - width
    seen[(task, canvas)] += 1
    # Long sums only get canvases that hold their 26-token answer; rows shrink as the canvas grows.
    assert canvas in ((32, 64) if task == "add" else (8, 16, 32, 64))
    assert B == dc.rows_for(task, canvas)
    assert np.all(b["norm_len"] == dc.answer_len_for(task))
    assert b["answer"][:, width:].all() and not b["answer"][:, :width].any()
    # Everything after the answer's own tokens is <|eos|>, whatever the canvas.
    region = b["tokens"][:, width:]
    base = dc.answer_len_for(task)
    assert np.all(region[:, base:] == tok_lib.EOS_ID)
  assert {c for t, c in seen if t == "arithmetic"} == {8, 16, 32, 64}
  assert {c for t, c in seen if t == "add"} == {32, 64}


def test_rows_keep_tokens_per_step_about_equal():
  dc = _config()
  assert dc.rows_for("arithmetic", 8) == 64
  for task in ("arithmetic", "add"):
    base_tokens = 64 * (dc.width(task) + dc.answer_len_for(task))
    for canvas in (c for c, _ in CANVASES if c >= dc.answer_len_for(task)):
      rows = dc.rows_for(task, canvas)
      assert rows % 8 == 0 and rows >= 8
      assert abs(rows * (dc.width(task) + canvas) / base_tokens - 1) < 0.25


def test_same_problems_on_every_canvas():
  # The answer of a problem does not depend on the canvas: rows of two canvases differ only in padding.
  from dinfer_jax import tasks
  it = tasks.iter_problems(_config().train_task("arithmetic"), "train", 3)
  probs = [next(it) for _ in range(4)]
  short = data_lib.make_rows(probs, 10, 8)
  long = data_lib.make_rows(probs, 10, 64)
  np.testing.assert_array_equal(long["tokens"][:, :18], short["tokens"])
  np.testing.assert_array_equal(long["positions"][:, :18], short["positions"])
  assert np.all(long["tokens"][:, 18:] == tok_lib.EOS_ID)


def test_bad_canvases_are_refused():
  with pytest.raises(ValueError, match="holds task 'add'"):
    data_lib.DataConfig(mix=(("add", 1.0),), canvases=((8, 1.0), (16, 1.0)))
  with pytest.raises(ValueError, match="canvases"):
    data_lib.DataConfig(canvases=((0, 1.0),))
  assert cli._parse_canvases("8=0.5, 64=0.5") == ((8, 0.5), (64, 0.5))
  with pytest.raises(ValueError, match="--canvases"):
    cli._parse_canvases("8:0.5")


def test_block_cut_masks_a_suffix_of_the_answer():
  answer = jnp.asarray(np.tile([False] * 5 + [True] * 12, (512, 1)))
  forced = np.asarray(objective.sample_block_cut(jax.random.PRNGKey(0), answer, 0.3))
  assert not forced[:, :5].any()
  on = forced.any(-1)
  assert 0.22 < on.mean() < 0.38
  for row in forced[on]:
    first = int(np.argmax(row))
    assert row[first:].all() and not row[:first].any()  # a suffix: all later blocks masked
  cuts = np.argmax(forced[on], -1) - 5
  assert set(cuts.tolist()) == set(range(12))  # any cut, so any block length
  assert not np.asarray(objective.sample_block_cut(jax.random.PRNGKey(0), answer, 0.0)).any()


def test_block_cut_span_keeps_every_cut_in_the_tasks_own_region():
  # A 64-token canvas whose answer is decoded in its first 8 positions: with span 8 every cut lands
  # there (so everything after the decoding block is masked, as at inference), and any of the 8 occurs.
  answer = jnp.asarray(np.tile([False] * 5 + [True] * 64, (512, 1)))
  span = jnp.full((512,), 8.0)
  forced = np.asarray(objective.sample_block_cut(jax.random.PRNGKey(1), answer, 1.0, span))
  cuts = np.argmax(forced, -1) - 5
  assert set(cuts.tolist()) == set(range(8))
  for row, cut in zip(forced, cuts):
    assert row[5 + cut:].all() and not row[:5 + cut].any()
  canvas = np.asarray(objective.sample_block_cut(jax.random.PRNGKey(1), answer, 1.0))
  assert (np.argmax(canvas, -1) - 5 >= 8).mean() > 0.8  # the old draw: mostly past the answer's block


def test_block_cut_span_is_validated_and_reaches_the_loss():
  from train_td import trainer
  with pytest.raises(ValueError, match="block_cut_span"):
    trainer.TrainConfig(block_cut_span="answer")
  with pytest.raises(ValueError, match="block_cut_span"):
    objective.make_loss_fn(trainer.TrainConfig().model_config(), block_cut_span="Task")
  tc = trainer.TrainConfig(d_model=32, n_layers=1, n_heads=2, n_experts=2, n_experts_per_tok=1,
                           expert_ffn_dim=32, max_position=128, batch_size=8, canvases=((64, 1.0),),
                           mix=(("program", 1.0),), block_mask_prob=1.0, block_cut_span="task")
  params, _ = trainer.init_state(tc)
  _, batch = data_lib.get_batch(tc.data_config(), 0)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  rng = jax.random.PRNGKey(3)
  masked = {span: float(objective.make_loss_fn(tc.model_config(), block_prob=1.0, block_cut_span=span)(
      params, batch, rng)[1]["masked_tokens"]) for span in objective.BLOCK_CUT_SPANS}
  # Every row cut within its first 8 of 64 positions masks more of the canvas than cuts anywhere in it.
  assert masked["task"] > masked["canvas"]
  assert masked["task"] >= batch["tokens"].shape[0] * (64 - 7)


def test_forced_positions_weigh_one_not_one_over_t():
  V = 4
  logits = jnp.log(jnp.full((1, 4, V), 1.0 / V, jnp.float32))
  targets = jnp.asarray([[0, 1, 2, 3]])
  masked = jnp.asarray([[False, True, True, True]])
  forced = jnp.asarray([[False, False, True, True]])
  t = jnp.asarray([0.25])
  got = objective.masked_diffusion_loss_from_masked(logits, targets, masked, t, jnp.asarray([2]), forced)
  ce = np.log(V)
  np.testing.assert_allclose(np.asarray(got), [(ce / 0.25 + 2 * ce) / 2], rtol=1e-6)


def test_loss_takes_norm_len_and_block_prob():
  from train_td import trainer
  tc = trainer.TrainConfig(d_model=32, n_layers=1, n_heads=2, n_experts=2, n_experts_per_tok=1,
                           expert_ffn_dim=32, max_position=128, batch_size=8, canvases=((8, 1.0), (32, 1.0)),
                           mix=(("arithmetic", 1.0),), block_mask_prob=0.5)
  params, _ = trainer.init_state(tc)
  dc = tc.data_config()
  step = next(s for s in range(50) if data_lib.get_batch(dc, s)[1]["tokens"].shape[1] == 10 + 32)
  _, batch = data_lib.get_batch(dc, step)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  rng = jax.random.PRNGKey(1)
  plain = objective.make_loss_fn(tc.model_config())
  with_block = objective.make_loss_fn(tc.model_config(), block_prob=0.5)
  l_norm = float(plain(params, batch, rng)[0])
  l_region = float(plain(params, {k: v for k, v in batch.items() if k != "norm_len"}, rng)[0])
  # Normalised by the task's 8-token region instead of the 32-token canvas: 4x the per-row loss.
  np.testing.assert_allclose(l_norm, 4 * l_region, rtol=1e-5)
  l_block, m_block = with_block(params, batch, rng)
  assert float(m_block["masked_tokens"]) > float(plain(params, batch, rng)[1]["masked_tokens"])
  assert np.isfinite(float(l_block))


def test_canvas_table_and_spread():
  from train_td import canvas
  rows = [{"task": "arithmetic", "gen_length": L, "block_length": 8, "accuracy": a, "correct": int(a * 400),
           "n": 400, "mean_tpf": 3.0, "mean_nfe": 1.1} for L, a in ((8, 0.97), (16, 0.965), (64, 0.9575))]
  assert abs(canvas.spread(rows, "arithmetic") - 0.0125) < 1e-12
  md = canvas.to_markdown(rows, "python -m train_td.canvas --task arithmetic")
  assert "| arithmetic | 64 | 8 | 0.9575 (383/400) |" in md
  assert "| arithmetic | 1.25 | - |" in md  # rows without answers: nothing to compare
  for r, answers in zip(rows, (["1", "2", "3"], ["1", "2", "4"], ["1", "5", "3"])):
    r["answers"] = answers
  assert canvas.same_answers(rows, "arithmetic") == (1, 3)  # only the first problem never changes
  assert "| arithmetic | 1.25 | 1/3 (0.333) |" in canvas.to_markdown(rows, "cmd")
  with pytest.raises(Exception):
    canvas._ints("8,0")


def test_canvas_counts_per_task_are_checked_before_the_model_loads(capsys):
  from train_td import canvas
  with pytest.raises(SystemExit) as e:
    canvas.main(["--model", "/nonexistent", "--task", "arithmetic,program", "--n", "program=433"])
  assert e.value.code == 2
  assert "no count for task(s) ['arithmetic']" in capsys.readouterr().err
