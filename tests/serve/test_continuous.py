"""The continuous batcher without HTTP: a request that arrives while others run joins them at the next block
boundary (it does not wait for the running call), a finished row leaves at once, answers equal the prompts
run alone, streaming gets every block, a cancelled running request leaves its slot."""
import threading

import dinfer_jax
from dinfer_jax import cli_common
from dinfer_jax.engine.slots import SlotPool
from dinfer_jax.serve.batcher import Job
from dinfer_jax.serve.continuous import ContinuousBatcher
from dinfer_jax.engine.programs import ProgramCache

QUESTIONS = ["What is 348+279?", "12 x 13", "f(0..5)=2,5,8,11,14,17", "905-417", "61*7", "f(0..5)=1,3,5,7,9,11"]


def _compiled(model, gcfg, prompts, buckets):
  programs = ProgramCache(16)
  for p in prompts:
    for b in buckets:
      SlotPool(model.params, model.config, gcfg, p, capacity=max(buckets), programs=programs).compile(b)
  return programs


def _long(gcfg):
  # Without the early stop every row decodes all of its 4 blocks: a long-running call to join.
  return gcfg.replace(block_length=4, gen_length=16, early_stop=False)


def test_a_request_joins_the_running_batch_at_a_block_boundary(default_model, default_gcfg):
  """B is submitted once A's first block has been decoded. With window batching B would wait for A's call
  to end; here it shares A's next block calls and both answers equal their prompts run alone."""
  g = _long(default_gcfg)
  ids = cli_common.encode_prompts(default_model, QUESTIONS[:2])
  programs = _compiled(default_model, g, ids[:1], [1, 2])
  calls, out, order = [], {}, []
  ev = threading.Event()
  b = ContinuousBatcher(default_model, max_batch=2, on_batch=calls.append, programs=programs)

  def finish(name):
    def f(res):
      out[name] = res
      order.append(name)
      if len(out) == 2:
        ev.set()
    return f
  submitted = []

  def a_tokens(rows):  # runs on the engine thread after each of A's blocks
    if not submitted:
      submitted.append(len(calls))
      b.submit(Job(prompt=ids[1], gcfg=g, on_done=finish("B")))
  b.submit(Job(prompt=ids[0], gcfg=g, on_done=finish("A"), on_tokens=a_tokens))
  b.start()
  try:
    assert ev.wait(120)
  finally:
    b.stop()
  assert order == ["A", "B"]  # A started first; B did not wait for it to end
  assert [c.rows for c in calls] == [1, 2, 2, 2, 1]  # B joined after A's block 0 and finished after A
  assert programs.compiles == 3  # the pool's regroup and two steps, before: nothing compiled on the way
  for name, p in zip("AB", ids):
    alone = dinfer_jax.generate(default_model, [p], g)
    assert (out[name][0].tokens, out[name][0].row_nfe) == (alone.tokens[0], alone.row_nfe[0])


def test_staggered_mixed_lengths_equal_single_runs(default_model, default_gcfg):
  """Six questions (two prompt buckets: two pools taking turns) submitted one after another while the
  others run; every answer equals its prompt alone; a short answer does not wait for a long one."""
  g = default_gcfg.replace(block_length=4, gen_length=16)
  ids = cli_common.encode_prompts(default_model, QUESTIONS)
  assert len({SlotPool.key(default_model.config, g, p)[1] for p in ids}) == 2
  programs = ProgramCache(16)
  # One slot per pool: every program is compiled before (two geometries), the pools still take turns and
  # a waiting request starts when a slot frees at a block boundary.
  b = ContinuousBatcher(default_model, max_batch=1, programs=programs)
  for p in ids:
    b._compile_spec(g, p, 1)
  out, ev = {}, threading.Event()

  def finish(i):
    def f(res):
      out[i] = res
      if len(out) == len(ids):
        ev.set()
    return f
  b.start()
  try:
    for i, p in enumerate(ids):
      b.submit(Job(prompt=p, gcfg=g, on_done=finish(i)))
      threading.Event().wait(0.02)
    assert ev.wait(180)
  finally:
    b.stop()
  for i, p in enumerate(ids):
    assert out[i][0].tokens == dinfer_jax.generate(default_model, [p], g).tokens[0], QUESTIONS[i]


def test_streaming_sampling_and_cancel(default_model, default_gcfg):
  """A streaming job gets each row's tokens block by block; a sampled job's n choices equal rows 0..n-1 of
  its seed alone; a running job cancelled after its first block leaves (on_drop) and is never answered."""
  g = _long(default_gcfg)
  gs = g.replace(temperature=1.0)
  ids = cli_common.encode_prompts(default_model, [QUESTIONS[0], QUESTIONS[1], QUESTIONS[3]])
  assert len({SlotPool.key(default_model.config, g, p)[1] for p in ids}) == 1  # one pool
  programs = _compiled(default_model, g, ids[:1], [1, 2])
  dropped, seen, out = [], [], {}
  ev = threading.Event()
  # The streaming and the cancelled job share one pool (2 slots), the sampled one has a pool of its own.
  b = ContinuousBatcher(default_model, max_batch=2, programs=programs, on_drop=dropped.append)
  for bucket in (1, 2):
    b._compile_spec(gs, ids[1], bucket)

  def finish(name):
    def f(res):
      out[name] = res
      if {"stream", "sampled"} <= set(out):
        ev.set()
    return f
  victim = Job(prompt=ids[2], gcfg=g, on_done=finish("victim"), on_tokens=lambda rows: victim.cancel())
  b.submit(Job(prompt=ids[0], gcfg=g, on_done=finish("stream"), on_tokens=seen.append))
  b.submit(Job(prompt=ids[1], gcfg=gs, n=2, seed=7, on_done=finish("sampled")))
  b.submit(victim)
  b.start()
  try:
    assert ev.wait(180)
  finally:
    b.stop()
  assert dropped == [victim] and "victim" not in out
  assert len(seen) == 4 and all(len(rows) == 1 for rows in seen)  # one update per block
  grown = [rows[0] for rows in seen]
  assert all(b2[:len(a)] == a for a, b2 in zip(grown, grown[1:])) and grown[-1] == out["stream"][0].tokens
  ref = dinfer_jax.generate(default_model, [ids[1]] * 2, gs, seed=7)
  assert [c.tokens for c in out["sampled"]] == ref.tokens


def test_serve_picks_the_batching_block_diffusion_included():
  """`serve` builds a ContinuousBatcher by default and a window batcher on --batching window; a LLaDA2 model
  (block diffusion: its slots keep each row's K/V across blocks) is served continuously too. Nothing
  compiles."""
  import argparse
  import pathlib

  from dinfer_jax.serve import cli as serve_cli
  p = argparse.ArgumentParser()
  serve_cli.register(p.add_subparsers())
  kinds, notes = [], []
  llada2 = pathlib.Path(__file__).resolve().parents[1] / "golden" / "forward" / "tiny_llada2_moe"
  for extra in ([], ["--batching", "window"], ["--model", str(llada2)]):
    _, b, _, _ = serve_cli.build(p.parse_args(["serve", "--warmup-max-prompt-len", "0"] + extra), log=notes.append)
    kinds.append(b.kind)
    assert b.programs.compiles == 0
  assert kinds == ["continuous", "window", "continuous"]
  assert not any("block diffusion" in n for n in notes)


def test_block_diffusion_reuses_prompt_blocks_across_requests():
  """LLaDA2 served continuously with a prefix cache: requests that share a system prompt, one after another,
  answer as alone; from the second on their shared blocks hit, and /metrics reports the hits and the
  prefill forwards saved."""
  import pathlib

  import numpy as np

  from dinfer_jax.engine.config import GenerationConfig
  from dinfer_jax.serve.metrics import Metrics
  model = dinfer_jax.load(pathlib.Path(__file__).resolve().parents[1] / "golden" / "forward" / "tiny_llada2_moe",
                          dtype="float32")
  g = GenerationConfig(gen_length=8, block_length=8, prompt_bucket=16, cache="dual", threshold=0.6)
  rng = np.random.default_rng(5)
  system = rng.integers(5, 200, size=16).tolist()
  prompts = [system + rng.integers(5, 200, size=n).tolist() for n in (4, 6, 2)]  # two whole blocks each
  metrics = Metrics(2)
  b = ContinuousBatcher(model, max_batch=2, prefix_cache_mb=1, on_batch=metrics.batch)
  metrics.prefix = b.prefix_stats
  out = []
  b.start()
  try:
    for p in prompts:
      ev = threading.Event()
      b.submit(Job(prompt=p, gcfg=g, on_done=lambda res, ev=ev: (out.append(res), ev.set())))
      assert ev.wait(120)
  finally:
    b.stop()
  for res, p in zip(out, prompts):
    assert res[0].tokens == dinfer_jax.generate(model, [p], g).tokens[0]
  text = metrics.render()
  assert "dinfer_prefix_cache_hit_blocks_total 4.0\n" in text and "dinfer_prefix_cache_miss_blocks_total 2.0\n" in text
  assert "dinfer_prefix_cache_prefills_saved_total 2.0\n" in text
