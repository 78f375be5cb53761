"""train_td objective and trainer: hand-computed loss, an optimizer step, determinism, resume, export."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dinfer_jax.model import params as params_lib
from train_td import data as data_lib
from train_td import export as export_lib
from train_td import objective, trainer
from train_td import tokenizer as tok_lib

TINY = dict(d_model=32, n_layers=2, n_heads=2, n_experts=4, n_experts_per_tok=2, expert_ffn_dim=32,
            batch_size=4, steps=3, warmup_steps=1, lr=1e-2, log_every=1, ckpt_every=2,
            mix=(("arithmetic", 1.0),))  # one batch shape: one compile


def tiny_config(**kw):
  return trainer.TrainConfig(**{**TINY, **kw})


def leaves_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


# ------------------------------------------------------------------------------------------- data
def test_rows_layout():
  p = data_lib.tasks_lib.Problem(task="arithmetic", prompt="  3+  4", answer="   7", split_keys=("k",))
  rows = data_lib.make_rows([p], prompt_width=12, answer_len=6)
  ids = data_lib.encode_text
  assert rows["tokens"][0].tolist() == ([0, 0, 0, tok_lib.USER_ID] + ids("  3+  4") + [tok_lib.ASSISTANT_ID]
                                        + ids("   7") + [tok_lib.EOS_ID] * 2)
  assert rows["valid"][0].tolist() == [False] * 3 + [True] * 15
  assert rows["positions"][0].tolist() == [0, 0, 0] + list(range(15))
  assert rows["answer"][0].tolist() == [False] * 12 + [True] * 6
  # An answer that fills the region exactly has no <|eos|>; a longer one is refused.
  full = data_lib.tasks_lib.Problem(task="program", prompt="f(0..5)=2,1,0,1,2,3", answer="abs(x-2)",
                                    split_keys=("k",))
  assert data_lib.make_rows([full], 24, 8)["tokens"][0, 24:].tolist() == ids("abs(x-2)")
  with pytest.raises(ValueError, match="answer_len=7"):
    data_lib.make_rows([full], 24, 7)
  # The same ids the shipped tokenizer's chat template produces for the question a user types.
  tok = tok_lib.build_tokenizer()
  text = tok.apply_chat_template([{"role": "user", "content": "3 + 4"}], tokenize=False, add_generation_prompt=True)
  assert tok.encode(text, add_special_tokens=False) == data_lib.encode_prompt("  3+  4")


def test_batches_are_deterministic_and_step_dependent():
  dc = data_lib.DataConfig(batch_size=8, seed=3)
  t1, b1 = data_lib.get_batch(dc, 5)
  t2, b2 = data_lib.get_batch(dc, 5)
  assert t1 == t2 and all(np.array_equal(b1[k], b2[k]) for k in b1)
  _, b3 = data_lib.get_batch(dc, 6)
  assert not np.array_equal(b1["tokens"], b3["tokens"]) or b1["tokens"].shape != b3["tokens"].shape
  tasks_seen = {data_lib.batch_task(dc, s) for s in range(50)}  # the default mix
  assert tasks_seen == {"arithmetic", "program"}


def test_arithmetic_batches_use_the_training_op_weights():
  def mul_share(dc):
    arith = [s for s in range(400) if data_lib.batch_task(dc, s) == "arithmetic"][:40]
    rows = [data_lib.get_batch(dc, s)[1]["tokens"] for s in arith]
    star = data_lib.encode_text("*")[0]
    return float(np.mean([(r == star).any(axis=1).mean() for r in rows]))
  assert abs(mul_share(data_lib.DataConfig(batch_size=64, arithmetic_op_weights=(1.0, 1.0, 2.0))) - 0.5) < 0.04
  assert abs(mul_share(data_lib.DataConfig(batch_size=64, arithmetic_op_weights=None)) - 1 / 3) < 0.04
  tc = trainer.TrainConfig(arithmetic_op_weights=(1.0, 2.0, 3.0))
  assert tc.data_config().arithmetic_op_weights == (1.0, 2.0, 3.0)
  assert trainer.TrainConfig.from_json(json.loads(json.dumps(tc.to_json()))) == tc
  # A run directory written before the field existed trained with uniform operators.
  old = {k: v for k, v in tc.to_json().items() if k != "arithmetic_op_weights"}
  assert trainer.TrainConfig.from_json(old).arithmetic_op_weights == (1.0, 1.0, 1.0)


def test_bad_op_weights_fail_before_the_run_directory_is_written(tmp_path):
  with pytest.raises(ValueError, match="op_weights"):
    trainer.train(tiny_config(arithmetic_op_weights=(1.0, 2.0)), tmp_path / "run")
  assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------- loss
def test_loss_hand_case():
  V = 5
  # Row 0: positions 2, 3 masked, t = 0.5, answer length 4.  Row 1: position 3 masked, t = 0.25.
  logits = jnp.log(jnp.asarray(np.full((2, 5, V), 1.0 / V), jnp.float32))
  logits = logits.at[0, 2].set(jnp.log(jnp.asarray([0.5, 0.125, 0.125, 0.125, 0.125])))
  targets = jnp.asarray([[1, 1, 0, 3, 4], [1, 1, 2, 2, 2]])
  masked = jnp.asarray([[False, False, True, True, False], [False, False, False, True, False]])
  t = jnp.asarray([0.5, 0.25])
  per_row = objective.masked_diffusion_loss_from_masked(logits, targets, masked, t, jnp.asarray([4, 4]))
  want0 = (-np.log(0.5) - np.log(1 / V)) / 0.5 / 4
  want1 = (-np.log(1 / V)) / 0.25 / 4
  np.testing.assert_allclose(np.asarray(per_row), [want0, want1], rtol=1e-6)


def test_mask_only_answer_and_t_range():
  answer = jnp.asarray(np.tile([False] * 6 + [True] * 10, (64, 1)))
  fractions = []
  for i in range(20):
    t, masked = objective.sample_mask(jax.random.PRNGKey(i), answer, eps=1e-3)
    assert bool(jnp.all((t > 1e-3 - 1e-7) & (t <= 1.0)))
    assert not bool(jnp.any(masked & ~answer))  # the prompt is never masked
    fractions.append(np.asarray(masked[:, 6:].mean(-1)) - np.asarray(t))
  # The masked fraction of each row tracks its t.
  assert abs(float(np.mean(fractions))) < 0.03


def test_full_loss_weights_by_t(monkeypatch):
  tc = tiny_config()
  cfg = tc.model_config()
  params, _ = trainer.init_state(tc)
  _, batch = data_lib.get_batch(tc.data_config(), 0)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  t_fixed = 0.5
  fixed = objective.sample_mask(jax.random.PRNGKey(0), batch["answer"])[1]
  monkeypatch.setattr(objective, "sample_mask",
                      lambda rng, answer, eps=1e-3: (jnp.full((answer.shape[0],), t_fixed), fixed))
  loss, metrics = jax.jit(objective.make_loss_fn(cfg))(params, batch, jax.random.PRNGKey(0))
  from dinfer_jax.model.transformer import forward
  noised = jnp.where(fixed, cfg.mask_token_id, batch["tokens"])
  assert bool(jnp.all(noised[~batch["answer"]] == batch["tokens"][~batch["answer"]]))
  logits = jax.jit(lambda p, x, pos, m: forward(p, cfg, x, positions=pos, mask=m).logits)(
      params, noised, batch["positions"], batch["valid"])
  logp = jax.nn.log_softmax(logits, -1)
  ce = -jnp.take_along_axis(logp, batch["tokens"][..., None], -1)[..., 0]
  want = float(jnp.mean(jnp.where(fixed, ce, 0).sum(-1) / t_fixed / tc.answer_len))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert metrics["masked_tokens"] == float(fixed.sum())


def test_optimizer_steps_decrease_loss():
  tc = tiny_config()
  cfg = tc.model_config()
  loss_fn = jax.jit(objective.make_loss_fn(cfg))
  params, _ = trainer.init_state(tc)
  opt = optax.adam(3e-3)
  step = trainer.make_train_step(loss_fn, opt)
  _, batch = data_lib.get_batch(tc.data_config(), 0)
  rng = jax.random.PRNGKey(1)
  before = float(loss_fn(params, batch, rng)[0])
  p, s = params, opt.init(params)
  for _ in range(3):
    p, s, m = step(p, s, batch, rng)
  after = float(loss_fn(p, batch, rng)[0])
  assert after < before
  assert np.isfinite(float(m["grad_norm"]))


def test_ragged_training_kernel_matches_dense():
  # Training runs the routed-only kernel; loss and gradients must be those of the dense kernel the
  # exported model is checked against.
  tc = tiny_config()
  params, _ = trainer.init_state(tc)
  _, batch = data_lib.get_batch(tc.data_config(), 0)
  rng = jax.random.PRNGKey(3)
  grads = {}
  for impl in ("dense", "ragged"):
    fn = objective.make_loss_fn(tc.model_config(), moe_impl=impl)
    grads[impl] = jax.jit(jax.value_and_grad(lambda p: fn(p, batch, rng)[0]))(params)
  np.testing.assert_allclose(grads["ragged"][0], grads["dense"][0], rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(grads["ragged"][1]), jax.tree_util.tree_leaves(grads["dense"][1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="moe_impl"):
    tiny_config(moe_impl="fast").model_config()


def test_schedule_warmup_then_cosine():
  tc = tiny_config(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
  sch = trainer.make_schedule(tc)
  assert float(sch(10)) == pytest.approx(1e-3)
  assert float(sch(5)) == pytest.approx(5e-4)
  assert float(sch(100)) == pytest.approx(1e-4)
  assert float(sch(50)) < 1e-3


# ------------------------------------------------------------------------------------------- trainer
@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory):
  d = tmp_path_factory.mktemp("run_a")
  out = trainer.train(tiny_config(), d, progress=False)
  return d, out


def test_deterministic_runs(three_step_run, tmp_path):
  d, out = three_step_run
  out2 = trainer.train(tiny_config(), tmp_path / "b", progress=False)
  assert leaves_equal(out["params"], out2["params"])
  lines = [json.loads(x) for x in (d / trainer.METRICS).read_text().splitlines()]
  assert [x["step"] for x in lines] == [1, 2, 3]
  assert all(k in lines[0] for k in ("loss", "lr", "tokens_per_s", "grad_norm"))
  # A different seed gives different weights.
  out3 = trainer.train(tiny_config(seed=1), tmp_path / "c", progress=False)
  assert not leaves_equal(out["params"], out3["params"])


def test_resume_continues_at_the_right_step(three_step_run, tmp_path):
  d_full, full = three_step_run
  d = tmp_path / "r"
  first = trainer.train(tiny_config(), d, progress=False, stop_at=2)
  assert first["step"] == 2 and trainer.latest_step(d) == 2
  with pytest.raises(FileExistsError):
    trainer.train(tiny_config(), d, progress=False, resume=False)
  second = trainer.train(tiny_config(), d, progress=False, resume=True)
  assert second["step"] == 3 and trainer.latest_step(d) == 3
  steps = [json.loads(x)["step"] for x in (d / trainer.METRICS).read_text().splitlines()]
  assert steps == [1, 2, 3]
  # Interrupted + resumed follows the uninterrupted trajectory exactly.
  assert leaves_equal(second["params"], full["params"])
  params, opt_state, s = trainer.restore(d)
  assert s == 3 and leaves_equal(params, full["params"])
  with pytest.raises(ValueError, match=r"different settings: lr \(saved 0.01, given 0.005\)"):
    trainer.train(tiny_config(lr=5e-3), d, progress=False)


# ------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_load_round_trip(three_step_run, tmp_path, dtype):
  import dinfer_jax
  d, _ = three_step_run
  out = tmp_path / "hf"
  res = export_lib.export_run(d, out, dtype=dtype)
  assert res["step"] == 3
  hf = json.loads((out / "config.json").read_text())
  assert hf["model_type"] == "llada" and hf["architectures"] == ["LLaDAMoEModelLM"]
  assert (hf["mask_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (2, 1, 0)
  assert hf["norm_topk_prob"] is False and hf["qk_layernorm"] is True and hf["torch_dtype"] == dtype
  assert hf["shared_expert_intermediate_size"] is None and hf["partial_rotary_factor"] == 1.0
  gen = json.loads((out / "generation_config.json").read_text())
  assert gen == dict(export_lib.DEFAULT_GENERATION, trained_tasks=["arithmetic"])  # the run's mix
  from dinfer_jax import checkpoint
  cfg = trainer.load_train_config(d).model_config()
  from dinfer_jax.checkpoint import safetensors_io
  assert set(safetensors_io.WeightSet(out).keys()) == set(checkpoint.expected_hf_keys(cfg))
  model = dinfer_jax.load(out)
  assert model.tokenizer is not None and model.config.n_experts == 4
  params, _, _ = trainer.restore(d)
  if dtype == "bfloat16":
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  ids = [data_lib.encode_prompt("12+34") + [tok_lib.MASK_ID] * 4]
  from dinfer_jax.model.transformer import forward
  want = forward(params, cfg, jnp.asarray(ids)).logits
  got = dinfer_jax.forward(model, ids)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- CLI errors, resume, extend
def _cli(argv, capsys):
  from train_td.__main__ import main
  rc = main([str(a) for a in argv])
  return rc, capsys.readouterr().err


_TINY_FLAGS = ["--d-model", 32, "--n-layers", 2, "--n-heads", 2, "--n-experts", 4, "--expert-ffn-dim", 32,
               "--batch-size", 4, "--steps", 3, "--warmup-steps", 1, "--lr", 1e-2, "--log-every", 1,
               "--ckpt-every", 2, "--mix", "arithmetic=1", "--no-progress"]


@pytest.mark.parametrize("flags, want", [
    (["--mix", "arithmetic=0.5,bogus=0.5"], "mix: unknown task 'bogus'"),
    (["--mix", "arithmetic"], "--mix: expected NAME=WEIGHT"),
    (["--steps", "0"], "steps must be an int >= 1, got 0"),
    (["--batch-size", "0"], "batch_size must be an int >= 1, got 0"),
    (["--lr", "-1"], "lr must be a number > 0"),
    (["--resume"], "has no checkpoints to resume from"),
    (["--init-from", "/nonexistent"], "init_from: /nonexistent is neither a run directory with checkpoints nor a model"),
    (["--init-from", "default"], "init_from: default is a"),  # the tiny flags build another architecture
])
def test_train_refusals_write_nothing(tmp_path, capsys, flags, want):
  rc, err = _cli(["train", tmp_path / "run", *_TINY_FLAGS, *flags], capsys)
  assert rc == 2 and err.strip().splitlines()[-1].startswith("error: ") and want in err, err
  assert "Traceback" not in err
  assert not (tmp_path / "run").exists()  # the corrected command is not refused afterwards


def test_train_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("mine")
  rc, err = _cli(["train", mine, *_TINY_FLAGS], capsys)
  assert rc == 2 and err.strip().splitlines()[-1:] == [
      f"error: {mine} exists and is not a train_td run directory (no train_config.json or td_config.json); "
      "give a new or empty directory"], err
  assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
  (mine / "notes.txt").unlink()  # an empty directory is a new run's
  assert _cli(["train", mine, *_TINY_FLAGS], capsys)[0] == 0
  assert (mine / trainer.TRAIN_CONFIG).is_file()


def test_init_from_a_model_starts_from_its_weights():
  import dinfer_jax
  model = dinfer_jax.load("default", dtype="float32")
  tc = trainer.TrainConfig(init_from="default", max_position=model.config.max_position)
  got = trainer._init_from_params(tc)
  assert leaves_equal(got, params_lib.stack_layers(model.params))
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(got))


@pytest.mark.parametrize("argv, want", [
    (["eval", "--model", "/nonexistent", "--task", "arithmetic"], "error: model path /nonexistent is not a directory"),
    (["export", "/nonexistent", "--out", "x"], "error: /nonexistent: not a run directory"),
])
def test_train_td_errors_are_one_line(tmp_path, capsys, argv, want):
  rc, err = _cli(argv, capsys)
  assert rc == 2 and err.strip().splitlines()[-1].startswith(want) and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["eval", "--task", "arithmetic", "--n", "-3"],
                                  ["eval", "--task", "arithmetic", "--batch", "0"],
                                  ["export", "RUN"]])  # --out is required: no default over the shipped model
def test_train_td_bad_flags_exit_2(capsys, argv):
  from train_td.__main__ import main
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "error: argument" in err or "required: --out" in err, err


def test_export_never_replaces_without_overwrite(three_step_run, tmp_path):
  d, _ = three_step_run
  out = tmp_path / "hf"
  export_lib.export_run(d, out)
  before = (out / "model.safetensors").read_bytes()
  with pytest.raises(ValueError, match="already exists"):
    export_lib.export_run(d, out)
  export_lib.export_run(d, out, overwrite=True)  # a model: replaced on request
  assert (out / "model.safetensors").read_bytes() == before
  # A model directory written by something else (like the shipped default before this rule) is a model too.
  from dinfer_jax.checkpoint import outdir
  (out / outdir.MARKER).unlink()
  export_lib.export_run(d, out, overwrite=True)
  assert (out / outdir.MARKER).is_file()
  # A directory that is no model is not replaced even with overwrite (e.g. --out .).
  cwd_like = tmp_path / "work"
  cwd_like.mkdir()
  (cwd_like / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match="not written by dinfer-jax"):
    export_lib.export_run(d, cwd_like, overwrite=True)
  assert (cwd_like / "notes.txt").read_text() == "mine"


def test_killed_run_resumes_without_duplicate_metrics(tmp_path):
  d = tmp_path / "r"
  trainer.train(tiny_config(), d, progress=False, stop_at=2)
  # A kill after step 3 was logged but before its checkpoint: the log is ahead of the checkpoint (and torn).
  with open(d / trainer.METRICS, "a") as f:
    f.write(json.dumps({"step": 3, "loss": 9.0}) + "\n" + '{"step": 4, "lo')
  with pytest.warns(UserWarning) as seen:
    trainer.train(tiny_config(), d, progress=False)
  said = [str(w.message) for w in seen]
  # Both losses are reported, not dropped silently: the torn line (named by file and line) and the record
  # logged past the checkpoint.
  assert any(f"{d / trainer.METRICS}:4: last line is not a whole metrics record" in m for m in said), said
  assert any("dropped 1 record(s) logged after step 2" in m for m in said), said
  lines = [json.loads(x) for x in (d / trainer.METRICS).read_text().splitlines()]
  assert [x["step"] for x in lines] == [1, 2, 3] and lines[2]["loss"] != 9.0


def test_finished_run_is_extended_on_the_same_schedule(three_step_run, tmp_path, capsys):
  import shutil
  d = tmp_path / "r"
  shutil.copytree(three_step_run[0], d)
  tc = tiny_config()
  # Only --steps given: every other setting comes from the run's train_config.json.
  rc, err = _cli(["train", d, "--steps", 5, "--no-progress"], capsys)
  assert rc == 0, err
  assert trainer.latest_step(d) == 5
  saved = trainer.load_train_config(d)
  assert (saved.steps, saved.schedule_steps) == (5, 3) and dataclasses_replace(saved, steps=3, schedule_steps=0) == tc
  lines = [json.loads(x) for x in (d / trainer.METRICS).read_text().splitlines()]
  assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
  # The first 3 steps are the original run's; then the schedule holds its final learning rate.
  end_lr = tc.lr * tc.min_lr_ratio
  assert [x["lr"] for x in lines[3:]] == pytest.approx([end_lr, end_lr])
  assert lines[2]["lr"] == pytest.approx(float(trainer.make_schedule(tc)(2)))
  rc, err = _cli(["train", d, "--steps", 5, "--lr", 0.5, "--no-progress"], capsys)
  assert rc == 2 and "lr (saved 0.01, given 0.5)" in err
  rc, err = _cli(["train", d, "--steps", 4, "--no-progress"], capsys)
  assert rc == 2 and "below the run's latest checkpoint (step 5)" in err


def dataclasses_replace(tc, **kw):
  import dataclasses
  return dataclasses.replace(tc, **kw)


def test_eval_refuses_bad_generation_knobs_in_one_line(capsys):
  rc, err = _cli(["eval", "--task", "arithmetic", "--n", 2, "--mask-id", 1000], capsys)
  assert rc == 2 and err.strip().splitlines()[-1] == (
      "error: --mask-id: mask_id=1000 is outside the model's vocabulary [0, 128)"), err


def test_a_nonfinite_step_stops_the_run_without_saving_and_export_refuses_nan(tmp_path):
  """Batches from step 3 on hold token ids outside the vocabulary (what a bad shard fed before shards were
  checked): the loss turns NaN, the run stops at step 3 without saving it, the step-2 checkpoint is kept and
  finite. export refuses a checkpoint with NaN weights unless allow_nonfinite."""
  tc = tiny_config(steps=4)
  good = lambda s: data_lib.get_batch(tc.data_config(), s)  # noqa: E731

  def poisoned(s):
    tag, b = good(s)
    if s >= 2:
      b = dict(b, tokens=np.where(b["valid"], 10**6, b["tokens"]).astype(b["tokens"].dtype))
    return tag, b
  run = tmp_path / "run"
  with pytest.raises(trainer.NonFiniteError, match=r"step 3: the loss or the gradient norm is NaN/inf.*step 2, is kept"):
    trainer.train(tc, run, progress=False, get_batch=poisoned)
  params, _, step = trainer.restore(run, tc, None)
  assert step == 2 and not params_lib.nonfinite_weights(params)
  bad = jax.tree_util.tree_map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), params)
  with pytest.raises(ValueError, match="NaN/inf weights in .*--allow-nonfinite"):
    export_lib.export_params(bad, tc.model_config(), tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_nonfinite_weights_under_a_finite_loss_are_never_saved_or_resumed(tmp_path):
  """An inf in an embedding row no batch reaches leaves the loss and the gradient finite (its gradient is
  zero); before, every checkpoint saved it, and retention (keep_checkpoints=2) deleted the finite ones."""
  tc = tiny_config(steps=4)
  params, _ = trainer.init_state(tc)
  bad = dict(params, embed=params["embed"].at[-1, 0].set(jnp.inf))  # the last row: no task uses it
  with pytest.raises(trainer.NonFiniteError, match=r"step 2 \(the last checkpoint, step None, is kept\): "
                     r"NaN/inf weights in embed \(1 values\); stopped without saving"):
    trainer.train(tc, tmp_path / "run", progress=False, init_params=bad)
  assert trainer.latest_step(tmp_path / "run") is None
  # A run resumed from a checkpoint with NaN/inf weights (saved before this check existed) is refused.
  run = tmp_path / "good"
  trainer.train(tc, run, progress=False, stop_at=2)
  good, opt, step = trainer.restore(run, tc)
  mngr = trainer._manager(run, tc)
  mngr.save(3, args=trainer.ocp.args.StandardSave({"params": dict(good, lm_head=good["lm_head"] * jnp.nan),
                                                   "opt_state": opt}), force=True)
  mngr.wait_until_finished()
  mngr.close()
  with pytest.raises(trainer.NonFiniteError, match=r"checkpoint step 3, the one this run resumes from: "
                     r"NaN/inf weights in lm_head \(4096 values\)"):
    trainer.train(tc, run, progress=False)


def _write_shard(path, **over):
  import pyarrow as pa
  import pyarrow.parquet as pq

  from train_td import td_data
  rec = dict(index=[0, 1], task=["arithmetic"] * 2, prompt=["1+1", "2+2"], prompt_ids=[[5, 6, 7], [5, 8, 7]],
             tokens=[[9, 10, 11], [12, 13, 14]], commit_step=[[1, 2, -1], [1, 1, 2]], n_steps=[2, 2],
             answer=["2", "4"])
  rec.update(over)
  path.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.table({c: rec[c] for c in td_data.COLUMNS}), path / "part-00000.parquet")
  return path


@pytest.mark.parametrize("over,why", [
    (dict(tokens=[[9, -5, 11], [12, 13, 14]]), r"record 0 \(index 0\): tokens holds token id -5, outside the vocabulary \[0, 64\)"),
    (dict(prompt_ids=[[5, 6, 7], [5, 10**6, 7]]), r"record 1 \(index 1\): prompt_ids holds token id 1000000"),
    (dict(commit_step=[[1, 3, -1], [1, 1, 2]]), r"record 0 \(index 0\): commit step 3 is neither -1 nor in \[1, n_steps=2\]"),
    (dict(commit_step=[[1, 2], [1, 1, 2]]), r"record 0 \(index 0\): 3 tokens but 2 commit steps"),
    (dict(n_steps=[0, 2]), r"record 0 \(index 0\): n_steps=0 must be an int >= 1"),
    (dict(n_steps=[None, 2]), r"record 0: column 'n_steps' is null")])
def test_shards_are_checked_as_they_are_read(tmp_path, over, why):
  """A trajectory shard that cannot be one is refused naming the file, the record and the value, before any
  step (token ids against the base model's vocabulary)."""
  from train_td import td_data
  good = _write_shard(tmp_path / "good")
  assert td_data.read_records(good, vocab_size=64)["n_steps"] == [2, 2]
  bad = _write_shard(tmp_path / "bad", **over)
  with pytest.raises(ValueError, match=r"part-00000\.parquet: " + why):
    td_data.read_records(bad, vocab_size=64)


def test_a_rerun_without_a_checkpoint_says_so(tmp_path):
  """A run that logged records but saved no checkpoint was said to resume "from step 0, the checkpoint this run
  resumes from", a checkpoint that never existed."""
  path = tmp_path / trainer.METRICS
  path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))
  with pytest.warns(UserWarning, match=r"dropped 7 record\(s\) of an earlier run that saved no checkpoint; this "
                    r"run starts at step 0") as said:
    trainer._truncate_metrics(path, 0)
  assert not any("resumes from" in str(w.message) for w in said) and path.read_text() == ""


def test_a_save_cut_short_leaves_nothing_behind_after_the_next_run(tmp_path):
  """Ctrl-C or SIGTERM inside a save leaves orbax's temporary step directory; the next training run over the
  directory removes it (a reader, restore, leaves it: the writer may be in that save)."""
  tc = tiny_config(steps=3)
  run = tmp_path / "run"
  trainer.train(tc, run, progress=False, stop_at=2)
  torn = run / trainer.CHECKPOINTS / "3.orbax-checkpoint-tmp-1700000000"
  torn.mkdir()
  (torn / "half").write_text("x")
  trainer.restore(run, tc)
  assert torn.exists()
  trainer.train(tc, run, progress=False)
  assert not torn.exists() and trainer.latest_step(run) == 3
