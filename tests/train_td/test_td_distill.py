"""Trajectory distillation: the TD loss by hand, trajectory states against the engine, collect (resume,
determinism, training prompts only, process split), TD training (base init, kill -9 + resume), default-td."""
import dataclasses
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.model import params as params_lib
import dinfer_jax
from dinfer_jax import api
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine import stepped
from train_td import collect as collect_lib
from train_td import data as data_lib
from train_td import export as export_lib
from train_td import objective, td_data, td_train, trainer
from dinfer_jax import tasks as tasks_lib
from dinfer_jax.tasks import base as tasks_base

pytest.importorskip("pyarrow")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(d_model=32, n_layers=2, n_heads=2, n_experts=4, n_experts_per_tok=2, expert_ffn_dim=32)
GEN = GenerationConfig(gen_length=8, block_length=4, threshold=0.5, cache="dual", prompt_bucket=16)


def leaves_bytes(tree):
  return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


class Parity(tasks_lib.ArithmeticTask):
  """Arithmetic prompts; accepts an answer iff its length plus the prompt's digit sum is even: a verifier a
  random model passes about half the time, so collect keeps some rows and rejects others."""
  name = "td-parity-test"

  def check(self, problem, answer_text):
    return (len(answer_text) + sum(int(c) for c in problem.prompt if c.isdigit())) % 2 == 0


@pytest.fixture(autouse=True)
def parity_task(monkeypatch):
  monkeypatch.setattr(tasks_base, "_REGISTRY", dict(tasks_base._REGISTRY))
  tasks_lib.register_task(Parity())


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
  tc = trainer.TrainConfig(**TINY)
  params, _ = trainer.init_state(tc)
  out = tmp_path_factory.mktemp("tiny_base") / "model"
  export_lib.export_params(params, tc.model_config(), out)
  return out


# ----------------------------------------------------------------------------------------- the loss
def test_transition_masks_and_terms_by_hand():
  # One row: prompt (2 positions, reveal 0) then 4 generated positions revealed after forwards 1, 3, 3, 2.
  reveal = jnp.asarray([[0, 0, 1, 3, 3, 2]])
  answer = jnp.asarray([[False, False, True, True, True, True]])
  masked, delta = objective.transition_masks(reveal, answer, jnp.asarray([1]), jnp.asarray([2]))
  assert masked.tolist() == [[False, False, False, True, True, True]]  # s_1: only position 2 revealed
  assert delta.tolist() == [[False, False, False, False, False, True]]  # revealed by forward 2
  _, delta13 = objective.transition_masks(reveal, answer, jnp.asarray([1]), jnp.asarray([3]))
  assert delta13.tolist() == [[False, False, False, True, True, True]]

  V = 4
  p = np.full((1, 6, V), 0.25, np.float32)
  p[0, 3] = [0.7, 0.1, 0.1, 0.1]  # target 0: right, p = 0.7
  p[0, 4] = [0.1, 0.2, 0.6, 0.1]  # target 1: wrong (argmax 2), p = 0.2
  p[0, 5] = [0.1, 0.1, 0.1, 0.7]  # target 3: right, p = 0.7
  targets = jnp.asarray([[1, 1, 2, 0, 1, 3]])
  terms = objective.compressed_transition_terms(jnp.log(jnp.asarray(p)), targets, masked, delta13)
  np.testing.assert_allclose(float(terms["nll"]), -(np.log(0.7) + np.log(0.2) + np.log(0.7)) / 3, rtol=1e-6)
  h = -(0.7 * np.log(0.7) + 3 * 0.1 * np.log(0.1))  # entropy of the two correct predictions (equal)
  np.testing.assert_allclose(float(terms["entropy"]), h, rtol=1e-6)
  np.testing.assert_allclose(float(terms["delta_acc"]), 2 / 3, rtol=1e-6)
  # Only Delta counts for the NLL: with Delta = {5} it is -log 0.7 whatever positions 3 and 4 predict.
  terms2 = objective.compressed_transition_terms(jnp.log(jnp.asarray(p)), targets, masked, delta)
  np.testing.assert_allclose(float(terms2["nll"]), -np.log(0.7), rtol=1e-6)


def test_sample_transition_covers_every_pair_and_nothing_else():
  n = jnp.asarray([1, 3, 5] * 400)
  seen = {1: set(), 3: set(), 5: set()}
  for i in range(5):
    a, b = objective.sample_transition(jax.random.PRNGKey(i), n)
    for nn, aa, bb in zip(n.tolist(), a.tolist(), b.tolist()):
      assert 0 <= aa < bb <= nn
      seen[nn].add((aa, bb))
  for nn, pairs in seen.items():
    assert pairs == {(x, y) for x in range(nn) for y in range(x + 1, nn + 1)}


def test_td_loss_equals_the_terms_of_one_forward(monkeypatch, tiny_model_dir):
  model = dinfer_jax.load(tiny_model_dir)
  rows = td_data.layout([[4, 10, 11, 5], [4, 12, 5]], [[20, 21, 1, 1], [22, 1, 1, 1]],
                        [[1, 2, -1, -1], [2, 1, -1, -1]], [2, 3])
  batch = {k: jnp.asarray(getattr(rows, k)) for k in ("tokens", "valid", "positions", "answer", "reveal", "n_steps")}
  a, b = jnp.asarray([1, 0]), jnp.asarray([2, 3])
  monkeypatch.setattr(objective, "sample_transition", lambda rng, n: (a, b))
  cfg = model.config
  loss, m = objective.make_td_loss_fn(cfg, cf_weight=0.5)(model.params, batch, jax.random.PRNGKey(0))
  from dinfer_jax.model.transformer import forward
  # Row 0 after 1 forward: position 0 revealed; row 1 after 0 forwards: all masked.
  state = np.asarray(batch["tokens"]).copy()
  state[0, 5:] = 2
  state[1, 4:] = 2
  logits = forward(model.params, cfg, jnp.asarray(state), positions=batch["positions"], mask=batch["valid"]).logits
  logp = np.asarray(jax.nn.log_softmax(logits, -1))
  tok = np.asarray(batch["tokens"])
  delta = [(0, 5), (0, 6), (0, 7), (1, 4), (1, 5), (1, 6), (1, 7)]  # row 0: reveal 2,2,2 (fill at n=2)
  nll = -np.mean([logp[r, c, tok[r, c]] for r, c in delta])
  masked = [(0, 5), (0, 6), (0, 7)] + [(1, c) for c in range(4, 8)]
  correct = [(r, c) for r, c in masked if logp[r, c].argmax() == tok[r, c]]
  ent = np.mean([-(np.exp(logp[r, c]) * logp[r, c]).sum() for r, c in correct]) if correct else 0.0
  np.testing.assert_allclose(float(m["td_nll"]), nll, rtol=1e-5)
  np.testing.assert_allclose(float(loss), nll + 0.5 * ent, rtol=1e-5)


# --------------------------------------------------------------------------- trajectories = engine
class _Recorder(stepped.ReferenceRunner):
  """The reference loop's runner, recording the whole canvas every full forward reads."""

  def __init__(self):
    self.canvases = []

  def forward(self, params, cfg, tokens, a, **kw):
    self.canvases.append((a, np.asarray(tokens).tolist()))
    return super().forward(params, cfg, tokens, a, **kw)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_states_from_a_trajectory_are_the_engines_canvases(tiny_model_dir, cache):
  model = dinfer_jax.load(tiny_model_dir)
  gcfg = GEN.replace(cache=cache, gen_length=12)
  prompts = [data_lib.encode_prompt(p.prompt) for p in tasks_lib.train_problems("arithmetic", 4, seed=1)]
  res = dinfer_jax.generate(model, prompts, gcfg)
  checked = 0
  for r, prompt in enumerate(prompts):
    rec = _Recorder()
    ref = stepped.stepped_generate(model.params, model.config, prompt, gcfg, runner=rec)
    P = res.prompt_lengths[r]
    tokens, commit, n = res.canvas[r][P:], res.commit_step[r], res.row_nfe[r]
    assert ref.commit_step == commit and ref.nfe == n
    assert td_data.state_at(prompt, tokens, commit, n, n) == res.canvas[r]
    assert td_data.state_at(prompt, tokens, commit, n, 0) == prompt + [model.config.mask_token_id] * 12
    for k, (a, canvas) in enumerate(rec.canvases):  # forward k + 1 reads the state after k forwards
      if a == 0 and len(canvas) == len(res.canvas[r]):  # full forwards (every one without a cache)
        assert td_data.state_at(prompt, tokens, commit, n, k) == canvas, (r, k)
        checked += 1
  assert checked >= (8 if cache == "none" else 3)


# ------------------------------------------------------------------------------------------- collect
def _cc(tiny_model_dir, **kw):
  gen = tuple(sorted(GEN.__dict__.items()))
  return collect_lib.CollectConfig(**{**dict(model=str(tiny_model_dir), task="td-parity-test", n=10, batch=4,
                                             generation=gen), **kw})


def _table(out):
  return td_data.read_records(out)


def test_collect_resume_determinism_and_split(tiny_model_dir, tmp_path):
  model = dinfer_jax.load(tiny_model_dir)
  full = collect_lib.collect(model, _cc(tiny_model_dir), tmp_path / "a", progress=False)
  assert full["attempted"] == 10 and full["batches"] == 3 and 0 < full["kept"] < 10
  rec = _table(tmp_path / "a")
  assert len(rec["index"]) == full["kept"] == len(set(rec["index"]))
  task = tasks_lib.get_task("td-parity-test")
  problems = list(itertools.islice(tasks_lib.iter_problems(task, "train", 0, unique=True), 10))
  for i, prompt, ans, toks, commit, n in zip(rec["index"], rec["prompt"], rec["answer"], rec["tokens"],
                                            rec["commit_step"], rec["n_steps"]):
    assert prompt == problems[i].prompt and tasks_lib.problem_split(task, problems[i]) == "train"
    assert task.check(problems[i], ans) and len(toks) == len(commit) == 8 and n >= 1
    assert max(commit) <= n and all(c == -1 or c >= 1 for c in commit)

  # Killed after one batch (and mid-write of the next: a stray temporary file), then resumed.
  d = tmp_path / "b"
  part = collect_lib.collect(model, _cc(tiny_model_dir), d, progress=False, stop_after=1)
  assert part["batches"] == 1
  (d / ".part-000-000001.parquet.tmp999").write_bytes(b"half a shard")
  rest = collect_lib.collect(model, _cc(tiny_model_dir), d, progress=False)
  assert rest == full
  assert _table(d) == rec  # same records, no duplicates
  # Deterministic for a seed; another seed runs other prompts.
  assert _table(tmp_path / "a") == _table(d)
  other = collect_lib.collect(model, _cc(tiny_model_dir, seed=1), tmp_path / "c", progress=False)
  assert set(_table(tmp_path / "c")["prompt"]) != set(rec["prompt"]) and other["attempted"] == 10
  # Two processes share the batches: together the same records as one.
  e = tmp_path / "e"
  for p in (0, 1):
    collect_lib.collect(model, _cc(tiny_model_dir), e, progress=False, process_index=p, process_count=2)
  assert sorted(x.name for x in e.glob("part-*")) == ["part-000-000000.parquet", "part-000-000002.parquet",
                                                      "part-001-000001.parquet"]
  both = _table(e)
  assert sorted(both["index"]) == sorted(rec["index"])
  # Other settings into the same directory: refused.
  with pytest.raises(ValueError, match="other settings"):
    collect_lib.collect(model, _cc(tiny_model_dir, n=11), d, progress=False)
  with pytest.raises(ValueError, match="temperature"):
    _cc(tiny_model_dir, generation=tuple(sorted(GEN.replace(temperature=1.0).__dict__.items())))


def test_collect_cli(tiny_model_dir, tmp_path, capsys):
  from train_td import __main__ as td_main
  rc = td_main.main(["collect", "--model", str(tiny_model_dir), "--task", "td-parity-test", "--n", "6",
                     "--batch", "3", "--out", str(tmp_path / "d"), "--no-progress", "--threshold", "0.5"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["attempted"] == 6 and out["kept"] + out["rejected"] == 6
  saved = json.loads((tmp_path / "d" / collect_lib.CONFIG).read_text())
  # Knobs not given come from the model's generation_config.json.
  assert saved["generation"]["threshold"] == 0.5 and saved["generation"]["cache"] == "dual"


def _distill(tiny_model_dir, tmp_path, out, *extra):
  from train_td import __main__ as td_main
  return td_main.main(["distill", "--base", str(tiny_model_dir), "--out", str(out), "--work", str(tmp_path / "w"),
                       "--tasks", "td-parity-test", "--n", "td-parity-test=4", "--task-weights", "", "--batch", "4",
                       "--steps", "2", "--batch-size", "2", "--warmup-steps", "1", "--no-progress", *extra])


def test_distill_refuses_an_existing_out_before_any_work(tiny_model_dir, tmp_path, capsys):
  out = tmp_path / "out"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  for extra in ((), ("--overwrite",)):  # not a model directory: refused even with --overwrite
    assert _distill(tiny_model_dir, tmp_path, out, *extra) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "w").exists() and (out / "notes.txt").read_text() == "mine"
  # Weights that do not name the --tasks are refused before collecting too.
  assert _distill(tiny_model_dir, tmp_path, tmp_path / "new", "--task-weights", "split=1") == 2
  assert "--task-weights" in capsys.readouterr().err and not (tmp_path / "w").exists()
  assert _distill(tiny_model_dir, tmp_path, tmp_path / "new", "--threshold", "1.5") == 2
  assert "threshold" in capsys.readouterr().err and not (tmp_path / "w").exists()
  # A threshold that is valid alone but not with the base's other settings: hierarchy's low_threshold 0.6.
  hier = tmp_path / "hier_base"
  shutil.copytree(tiny_model_dir, hier)
  gen = json.loads((hier / "generation_config.json").read_text())
  (hier / "generation_config.json").write_text(json.dumps(dict(gen, decoder="hierarchy", low_threshold=0.6)))
  assert _distill(hier, tmp_path, tmp_path / "new", "--threshold", "0.5") == 2
  assert "low_threshold" in capsys.readouterr().err and not (tmp_path / "w").exists()


@pytest.mark.slow  # collect + 2 TD steps + export, twice: -m slow
def test_distill_overwrite_replaces_an_earlier_model(tiny_model_dir, tmp_path, capsys):
  out = tmp_path / "td"
  assert _distill(tiny_model_dir, tmp_path, out) == 0
  first = (out / "model.safetensors").read_bytes()
  assert _distill(tiny_model_dir, tmp_path, out) == 2  # exists: refused, untouched
  assert "--overwrite" in capsys.readouterr().err and (out / "model.safetensors").read_bytes() == first
  base_gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
  assert json.loads((out / "generation_config.json").read_text()) == base_gen
  # The run is finished, so a rerun only re-exports: same weights, the directory replaced, and --threshold
  # changes the exported decoding threshold only.
  assert _distill(tiny_model_dir, tmp_path, out, "--overwrite", "--threshold", "0.7") == 0
  assert (out / "model.safetensors").read_bytes() == first
  assert json.loads((out / "generation_config.json").read_text()) == dict(base_gen, threshold=0.7)
  assert dinfer_jax.load(out).config == dinfer_jax.load(tiny_model_dir).config


# ------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def td_data_dir(tiny_model_dir, tmp_path_factory):
  mp = pytest.MonkeyPatch()
  mp.setattr(tasks_base, "_REGISTRY", dict(tasks_base._REGISTRY))
  tasks_lib.register_task(Parity(), replace=True)
  d = tmp_path_factory.mktemp("td_data")
  collect_lib.collect(dinfer_jax.load(tiny_model_dir), _cc(tiny_model_dir, n=24, batch=8), d, progress=False)
  mp.undo()
  return d


KW = dict(steps=6, batch_size=4, warmup_steps=1, lr=1e-2, log_every=1, ckpt_every=1)


def test_td_batches_and_base_init(td_data_dir, tiny_model_dir, tmp_path):
  data = td_data.TDData.load(str(td_data_dir), 4, seed=0)
  t1, b1 = data.get_batch(3)
  t2, b2 = data.get_batch(3)
  assert t1 == t2 and all(np.array_equal(b1[k], b2[k]) for k in b1)
  assert set(b1) == {"tokens", "valid", "positions", "answer", "reveal", "n_steps"}
  assert (b1["reveal"][~b1["answer"]] == 0).all() and (b1["reveal"][b1["answer"]] >= 1).all()
  assert (b1["reveal"].max(-1) <= b1["n_steps"]).all()
  # Stopped before its first step, a run holds the base model's weights: the run starts from them.
  out = td_train.train(td_train.TDConfig(data=str(td_data_dir), base=str(tiny_model_dir)), tmp_path / "r0",
                       progress=False, stop_at=0, **{**KW, "steps": 1})
  base = dinfer_jax.load(tiny_model_dir)
  assert leaves_bytes(out["params"]) == leaves_bytes(params_lib.stack_layers(base.params))
  with pytest.raises(ValueError, match="TD settings"):
    td_train.train(td_train.TDConfig(data=str(td_data_dir), base=str(tiny_model_dir), cf_weight=1.0),
                   tmp_path / "r0", progress=False, **{**KW, "steps": 1})


def test_task_weights_set_how_often_each_task_makes_a_batch(td_data_dir, tiny_model_dir, tmp_path):
  rows = td_data.TDData.load(str(td_data_dir), 4, seed=0).rows["td-parity-test"]
  two = {"a": rows, "b": rows}
  draw = lambda **kw: [td_data.TDData(two, 4, seed=0, **kw).get_batch(s)[0] for s in range(400)]
  assert set(draw(task_weights=(("a", 1.0), ("b", 0.0)))) == {"a"}
  share = draw(task_weights=(("a", 3.0), ("b", 1.0))).count("a") / 400
  assert 0.68 < share < 0.82, share  # 0.75 expected; 400 draws: +-0.07 is over 3 sigma
  assert 0.4 < draw().count("a") / 400 < 0.6  # no weights: by trajectories, equal here
  for bad, msg in (((("a", 1.0),), "missing \\['b'\\]"), ((("a", 1.0), ("b", 1.0), ("c", 1.0)), "not in the data"),
                   ((("a", 0.0), ("b", 0.0)), "one > 0")):
    with pytest.raises(ValueError, match=msg):
      td_data.TDData(two, 4, task_weights=bad)
  # A run records its weights; resuming with others is refused, and a run from before the field (no
  # task_weights in td_config.json) resumes as the unweighted run it was.
  tdc = td_train.TDConfig(data=str(td_data_dir), base=str(tiny_model_dir))
  td_train.train(tdc, tmp_path / "r", progress=False, stop_at=0, **{**KW, "steps": 1})
  f = tmp_path / "r" / td_train.TD_CONFIG
  saved = json.loads(f.read_text())
  assert saved["task_weights"] == []
  f.write_text(json.dumps({k: v for k, v in saved.items() if k != "task_weights"}))
  td_train.train(tdc, tmp_path / "r", progress=False, stop_at=0, **{**KW, "steps": 1})
  with pytest.raises(ValueError, match="TD settings"):
    td_train.train(dataclasses.replace(tdc, task_weights=(("td-parity-test", 1.0),)), tmp_path / "r",
                   progress=False, stop_at=0, **{**KW, "steps": 1})


def test_changed_or_damaged_data_is_refused(td_data_dir, tiny_model_dir, tmp_path):
  """Shards carry their records' digest: a shard whose records changed after it was written is refused by
  name. A run records its data's fingerprint (contents, not path): resuming on other data is refused unless
  allow_data_change."""
  import pyarrow.parquet as pq
  data = tmp_path / "data"
  shutil.copytree(td_data_dir, data)
  tdc = td_train.TDConfig(data=str(data), base=str(tiny_model_dir))
  td_train.train(tdc, tmp_path / "r", progress=False, stop_at=0, **{**KW, "steps": 1})
  assert json.loads((tmp_path / "r" / td_train.TD_CONFIG).read_text())["data_fingerprint"]
  shard = sorted(data.glob(td_data.SHARD_GLOB))[0]
  t = pq.read_table(shard)
  answers = t.column("answer").to_pylist()
  answers[0] = answers[0] + "x"  # a changed record, its stored digest kept (what a flipped bit does)
  pq.write_table(t.set_column(t.column_names.index("answer"), "answer", [answers]), shard)
  with pytest.raises(ValueError, match=f"{shard.name}: its records changed since it was written"):
    td_data.read_records(str(data))
  # Rewritten whole (a new digest): the run's recorded fingerprint no longer matches.
  from train_td import collect as collect_mod
  cols = {c: pq.read_table(shard).column(c).to_pylist() for c in td_data.COLUMNS}
  collect_mod._write_shard(shard, cols, {"batch": 0, "attempted": 1, "kept": 1})
  with pytest.raises(ValueError, match="trajectory data changed since this run began.*--allow-data-change"):
    td_train.train(tdc, tmp_path / "r", progress=False, stop_at=0, **{**KW, "steps": 1})
  td_train.train(tdc, tmp_path / "r", progress=False, stop_at=0, allow_data_change=True, **{**KW, "steps": 1})


@pytest.mark.slow  # over 20 s on 2 cores: -m slow
def test_td_run_killed_and_resumed_ends_byte_identical(td_data_dir, tiny_model_dir, tmp_path):
  tdc = td_train.TDConfig(data=str(td_data_dir), base=str(tiny_model_dir), mdm_weight=0.5, cf_weight=0.5)
  run = tmp_path / "killed"
  cmd = [sys.executable, "-m", "train_td", "train", str(run), "--td", str(td_data_dir), "--base", str(tiny_model_dir),
         "--mdm-weight", "0.5", "--cf-weight", "0.5", "--no-progress"] + sum(
             ([f"--{k.replace('_', '-')}", str(v)] for k, v in {**KW, "steps": 200}.items()), [])
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    deadline = time.time() + 240
    while (trainer.latest_step(run) or 0) < 3:
      assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
      assert time.time() < deadline, "the TD run made no checkpoint in time"
      time.sleep(0.2)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  # The killed run was started for 200 steps; its config says so, so resume it as the same 200-step run and
  # compare its step 6 with a 200-step reference stopped at 6: same schedule, same batches, same bytes.
  resumed = td_train.train(tdc, run, progress=False, resume=True, stop_at=6, **{**KW, "steps": 200})
  ref200 = td_train.train(tdc, tmp_path / "ref200", progress=False, stop_at=6, **{**KW, "steps": 200})
  assert resumed["step"] == 6 and leaves_bytes(resumed["params"]) == leaves_bytes(ref200["params"])
  losses = [json.loads(x)["loss"] for x in (tmp_path / "ref200" / trainer.METRICS).read_text().splitlines()]
  assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] != losses[0]


# ------------------------------------------------------------------------------------------- default-td
def test_default_td_resolves_like_default_once_installed(tmp_path, monkeypatch, tiny_model_dir, capsys):
  monkeypatch.setattr(api, "ASSETS_DIR", tmp_path)
  with pytest.raises(FileNotFoundError, match="default-td.*distill"):
    dinfer_jax.load("default-td")
  import shutil
  shutil.copytree(tiny_model_dir, tmp_path / "default-td")
  m = dinfer_jax.load("default-td")
  assert m.path == str(tmp_path / "default-td") and m.config.d_model == 32
  from dinfer_jax import cli, cli_common
  assert cli.main(["generate", "--model", "default-td", "3 + 4", "-v"]) == 0
  assert "nfe" in capsys.readouterr().err


def test_prompt_rules_pick_the_long_settings_for_long_tasks(tmp_path):
  import argparse
  from dinfer_jax import cli, cli_common
  # A run that trained sort gets its rule; one that did not keeps the plain defaults.
  assert export_lib.run_generation_config(trainer.TrainConfig(mix=(("arithmetic", 1.0),))) == \
      dict(export_lib.DEFAULT_GENERATION, trained_tasks=["arithmetic"])
  gen = export_lib.run_generation_config(trainer.TrainConfig(mix=(("arithmetic", 0.6), ("sort", 0.4))))
  assert gen == dict(export_lib.DEFAULT_GENERATION, prompt_rules=[export_lib.TASK_PROMPT_RULES["sort"]],
                     trained_tasks=["arithmetic", "sort"])
  (tmp_path / "generation_config.json").write_text(json.dumps(gen))
  from train_td import tokenizer as tok_lib
  args = argparse.Namespace()
  short = cli_common.generation_config(args, str(tmp_path), tok_lib.format_chat("What is 3 + 4?"))
  long = cli_common.generation_config(args, str(tmp_path), tok_lib.format_chat("sort 4, 7, 9"))
  assert (short.gen_length, short.block_length) == (8, 8)
  assert (long.gen_length, long.block_length) == (data_lib.DEFAULT_TASK_ANSWER_LEN["sort"], 8)
  assert long.cache == "dual" and long.threshold == 0.9  # the rest from the file's defaults
  # Flags still win over the rule.
  assert cli_common.generation_config(argparse.Namespace(gen_length=16), str(tmp_path),
                               tok_lib.format_chat("sort 1 2")).gen_length == 16
  # Every sort answer fits the rule's region with its <|eos|>.
  assert tasks_lib.get_task("sort").answer_chars + 1 <= long.gen_length
  # The long-addition rule (the default model's long task): a user's long sum gets its region.
  gen = export_lib.run_generation_config(trainer.TrainConfig(mix=(("arithmetic", 0.6), ("add", 0.4))))
  assert gen["prompt_rules"] == [export_lib.TASK_PROMPT_RULES["add"]]
  (tmp_path / "generation_config.json").write_text(json.dumps(gen))
  add = cli_common.generation_config(args, str(tmp_path), tok_lib.format_chat("What is 12345678901 + 98765432109?"))
  assert (add.gen_length, add.block_length) == (data_lib.DEFAULT_TASK_ANSWER_LEN["add"], 8)
  assert tasks_lib.get_task("add").answer_chars + 1 <= add.gen_length
  assert cli_common.generation_config(args, str(tmp_path), tok_lib.format_chat("What is 3 + 4?")).gen_length == 8


def test_eval_compares_models_at_the_first_models_settings(tmp_path, capsys):
  from train_td import __main__ as td_main
  tc = trainer.TrainConfig(**TINY, max_position=128)  # a sort row is up to 54 + 48 positions
  dirs = []
  for seed in (0, 1):
    params, _ = trainer.init_state(dataclasses.replace(tc, seed=seed))
    d = tmp_path / f"m{seed}"
    gen = (dict(export_lib.DEFAULT_GENERATION, threshold=0.7, prompt_rules=[export_lib.TASK_PROMPT_RULES["sort"]])
           if seed == 0 else {"gen_length": 4, "block_length": 2})
    export_lib.export_params(params, tc.model_config(), d, generation_config=gen)
    dirs.append(str(d))
  rc = td_main.main(["eval", "--model", ",".join(dirs), "--task", "arithmetic,sort", "--n", "3", "--batch", "3",
                     "--json"])
  assert rc == 0
  out = capsys.readouterr().out.strip().splitlines()
  res = json.loads(out[-1])
  assert [(r["task"], r["model"]) for r in res] == [("arithmetic", dirs[0]), ("arithmetic", dirs[1]),
                                                     ("sort", dirs[0]), ("sort", dirs[1])]
  for r in res:  # both models decode with the first one's file and its rule for sort
    g = r["generation_config"]
    assert g["threshold"] == 0.7 and (g["gen_length"], g["block_length"]) == (
        (48, 8) if r["task"] == "sort" else (8, 8))
  assert any(line.startswith("| sort | ") for line in out)


def test_distill_weights_and_checkpoints_follow_the_tasks(monkeypatch):
  """`--tasks split,arithmetic` alone failed on the recipe's weights for four tasks, a flag never given; the
  recipe's weights now apply to the tasks asked for (by trajectories if one has none), and --ckpt-every sets
  the checkpoint interval (15 minutes of training wrote nothing)."""
  from train_td import __main__ as td_main
  seen = []
  monkeypatch.setattr(td_main.distill, "main", lambda a: seen.append(a) or 0)
  base = ["distill", "--out", "o", "--work", "w"]
  assert td_main.main(base + ["--tasks", "split,arithmetic"]) == 0
  assert seen[-1].task_weights == (("split", 0.4), ("arithmetic", 0.3)) and seen[-1].ckpt_every == 50
  assert td_main.main(base + ["--tasks", "split,td-parity-test", "--ckpt-every", "7"]) == 0
  assert seen[-1].task_weights == () and seen[-1].ckpt_every == 7
  assert td_main.main(base + ["--tasks", "split", "--task-weights", "split=1"]) == 0
  assert seen[-1].task_weights == (("split", 1.0),)


def test_collect_names_the_setting_that_differs(tiny_model_dir, tmp_path):
  """Collecting into a directory made with other settings named none of them (the whole dict was dumped)."""
  cc = _cc(tiny_model_dir)
  collect_lib._prepare_dir(cc, tmp_path / "d")
  gen = dict(cc.generation, threshold=0.75)
  other = dataclasses.replace(cc, n=12, generation=tuple(sorted(gen.items())))
  with pytest.raises(ValueError, match=r"other settings: generation\.threshold: saved 0\.5, now 0\.75; n: saved 10, "
                     r"now 12; collect into a new directory"):
    collect_lib._prepare_dir(other, tmp_path / "d")
