"""The dynamic batcher without HTTP: batched rows equal single runs, bounded queue, cancelled jobs dropped,
seeded sampling reproducible; the stop/stream text helpers."""
import threading
import time

import pytest

import dinfer_jax
from dinfer_jax import cli_common
from dinfer_jax.serve.batcher import DynamicBatcher, Job, QueueFull, batch_buckets, bucket_for
from dinfer_jax.answer import cut_at_stop, settled_prefix

QUESTIONS = ["What is 348+279?", "12 x 13", "f(0..5)=2,5,8,11,14,17", "905-417", "61*7", "f(0..5)=1,3,5,7,9,11"]


def _collect(batcher, jobs_args, gcfg):
  out, done = {}, threading.Event()

  def cb(i):
    def f(r):
      out[i] = r
      if len(out) == len(jobs_args):
        done.set()
    return f

  jobs = [batcher.submit(Job(prompt=p, gcfg=g or gcfg, on_done=cb(i), n=n, seed=s))
          for i, (p, g, n, s) in enumerate(jobs_args)]
  return jobs, out, done


def test_buckets():
  assert batch_buckets(1) == [1]
  assert batch_buckets(6) == [1, 2, 4, 6]
  assert batch_buckets(8) == [1, 2, 4, 8]
  assert [bucket_for(r, 6) for r in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


def test_batched_rows_equal_single_runs(default_model, default_gcfg):
  """Mixed prompt lengths (two prompt buckets) submitted together run in shared calls, padded to a batch
  bucket with invalid rows; every answer equals running its prompt alone."""
  ids = cli_common.encode_prompts(default_model, QUESTIONS)
  assert len({len(p) for p in ids}) > 1
  alone = [dinfer_jax.generate(default_model, [p], default_gcfg).tokens[0] for p in ids]
  calls = []
  b = DynamicBatcher(default_model, max_batch=4, window_s=0.2, on_batch=calls.append)
  _, out, done = _collect(b, [(p, None, 1, 0) for p in ids], default_gcfg)
  b.start()
  try:
    assert done.wait(120)
  finally:
    b.stop()
  assert [out[i][0].tokens for i in range(len(ids))] == alone
  assert sum(c.rows for c in calls) == len(ids) and len(calls) < len(ids)
  assert all(c.bucket in (1, 2, 4) and c.bucket >= c.rows for c in calls)


def test_streaming_jobs_get_tokens_block_by_block(default_model, default_gcfg):
  import dataclasses
  default_gcfg = dataclasses.replace(default_gcfg, block_length=4)  # two blocks, so two streamed updates
  ids = cli_common.encode_prompts(default_model, [QUESTIONS[2], QUESTIONS[0]])
  got, done = [], threading.Event()
  b = DynamicBatcher(default_model, max_batch=2, window_s=0.2)
  final = {}
  b.submit(Job(prompt=ids[0], gcfg=default_gcfg, on_done=lambda r: (final.setdefault(0, r), done.set()),
               on_tokens=got.append))
  b.submit(Job(prompt=ids[1], gcfg=default_gcfg, on_done=lambda r: None))  # a plain job in the same batch
  b.start()
  try:
    assert done.wait(120)
  finally:
    b.stop()
  assert [len(rows) for rows in got] == [1, 1] and got[-1][0] == final[0][0].tokens
  assert len(got[0][0]) < len(got[1][0])  # block 0, then blocks 0-1


def test_queue_bound_and_cancelled_jobs_are_dropped(default_model, default_gcfg):
  ids = cli_common.encode_prompts(default_model, QUESTIONS[:3])
  dropped = []
  b = DynamicBatcher(default_model, max_batch=4, window_s=0.0, max_queue=2, on_drop=dropped.append)
  jobs, out, _ = _collect(b, [(ids[0], None, 1, 0), (ids[1], None, 1, 0)], default_gcfg)
  with pytest.raises(QueueFull, match="queue is full"):
    b.submit(Job(prompt=ids[2], gcfg=default_gcfg, on_done=lambda r: None))
  assert b.depth == 2
  jobs[0].cancel()  # its client went away before the worker started
  b.start()
  try:
    for _ in range(200):
      if 1 in out:
        break
      threading.Event().wait(0.05)
  finally:
    b.stop()
  assert 0 not in out and dropped == [jobs[0]]
  assert out[1][0].tokens == dinfer_jax.generate(default_model, [ids[1]], default_gcfg).tokens[0]
  assert b.depth == 0


@pytest.mark.slow  # compiles/indexes more than the default suite can afford
def test_seeded_sampling_runs_alone_and_reproduces(default_model, default_gcfg):
  """A sampled request's n choices are rows 0..n-1 of one call with its seed, whatever else is queued."""
  g = default_gcfg.replace(temperature=1.0)
  ids = cli_common.encode_prompts(default_model, QUESTIONS[:2])
  ref = dinfer_jax.generate(default_model, [ids[0]] * 3, g, seed=7).tokens
  b = DynamicBatcher(default_model, max_batch=4, window_s=0.2)
  _, out, done = _collect(b, [(ids[1], None, 1, 0), (ids[0], g, 3, 7), (ids[1], g, 1, 3)], default_gcfg)
  b.start()
  try:
    assert done.wait(120)
  finally:
    b.stop()
  assert [c.tokens for c in out[1]] == ref


def test_validate_uses_the_engine_checks(default_model, default_gcfg):
  b = DynamicBatcher(default_model, max_batch=2)
  with pytest.raises(ValueError, match="max_position"):
    b.validate([5] * (default_model.config.max_position + 1), default_gcfg)
  with pytest.raises(ValueError, match="n=3"):
    b.validate([5, 6], default_gcfg.replace(temperature=0.5), n=3)
  b.validate([5, 6], default_gcfg, n=3)  # greedy choices share one row


def test_a_batch_whose_program_compiles_does_not_hold_up_ready_ones(default_model, default_gcfg):
  """A request whose program is not compiled yet waits for it on the compile thread; a later request whose
  program is ready is answered meanwhile. Both answers equal the prompts run alone."""
  from dinfer_jax.engine.generate import compile_program
  from dinfer_jax.engine.programs import ProgramCache
  programs = ProgramCache(8)
  b = DynamicBatcher(default_model, max_batch=1, window_s=0.0, programs=programs)
  short, long_ = [5, 6, 7], [5, 6, 7, 8] * 10  # prompt buckets 16 and 48
  assert compile_program(programs, default_model, [short], default_gcfg, batch_bucket=1)
  done, order = {}, []
  ev = threading.Event()

  def finish(name):
    def f(res):
      done[name] = res
      order.append(name)
      if len(done) == 2:
        ev.set()
    return f
  b.start()
  try:
    b.submit(Job(prompt=long_, gcfg=default_gcfg, on_done=finish("cold")))
    time.sleep(0.3)  # the cold batch is taken first
    b.submit(Job(prompt=short, gcfg=default_gcfg, on_done=finish("ready")))
    assert ev.wait(300)
  finally:
    b.stop()
  assert order == ["ready", "cold"]
  assert programs.compiles == 2
  for name, prompt in (("cold", long_), ("ready", short)):
    assert done[name][0].tokens == dinfer_jax.generate(default_model, [prompt], default_gcfg).tokens[0]


def test_program_cache_is_bounded_and_builds_once():
  from dinfer_jax.engine.programs import ProgramCache
  pc = ProgramCache(2)
  built = []
  gate = threading.Event()

  def slow():
    gate.wait(5)
    built.append(1)
    return object()
  threads = [threading.Thread(target=pc.get, args=("a", slow)) for _ in range(4)]
  for t in threads:
    t.start()
  time.sleep(0.1)
  gate.set()
  for t in threads:
    t.join()
  assert len(built) == 1 and pc.compiles == 1  # four callers, one build
  pc.get("b", object)
  pc.get("a", object)  # a is used again: b is now the oldest
  pc.get("c", object)
  assert pc.ready("a") and pc.ready("c") and not pc.ready("b") and pc.evictions == 1 and len(pc) == 2
  with pytest.raises(ValueError, match="max_programs"):
    ProgramCache(0)


def test_cut_at_stop():
  assert cut_at_stop("x*3+2", ["+", "*"]) == ("x", True)
  assert cut_at_stop("627", ["9"]) == ("627", False)
  assert cut_at_stop("abc", None) == ("abc", False)


def test_settled_prefix_holds_back_what_later_tokens_may_change():
  assert settled_prefix("x*3+2", None) == "x*3+2"
  assert settled_prefix("x*3+2", ["+"]) == "x*3"  # a stop found: nothing after it
  assert settled_prefix("x*3+", ["+2"]) == "x*3"  # "+" may start "+2"
  assert settled_prefix("xcab", ["ab", "cabXY"]) == "x"  # "cab" may start the earlier "cabXY"
  assert settled_prefix("ab\ufffd", None) == "ab"  # half a multi-byte character


def test_serve_warms_the_prompt_rule_programs_too():
  """The default model's long-sum rule (gen_length 32) is a program of its own: the server's warm-up
  compiles it for every prompt bucket and batch bucket, as it does the default config's, single short
  prompts first; building the server compiles nothing."""
  import argparse

  from dinfer_jax.serve import cli as serve_cli
  p = argparse.ArgumentParser()
  sub = p.add_subparsers()
  serve_cli.register(sub)
  args = p.parse_args(["serve", "--warmup-max-prompt-len", "48", "--max-batch", "4"])
  _, batcher, _, specs = serve_cli.build(args, log=lambda m: None)
  assert len(batcher.programs) == 0 and batcher.programs.compiles == 0
  got = [(b, len(prompt), g.gen_length) for g, prompt, b in specs]
  assert sorted(got) == sorted((b, P, G) for b in (1, 2, 4) for P in (16, 32, 48) for G in (8, 32))
  assert got[:2] == [(1, 16, 8), (1, 16, 32)] and got == sorted(got, key=lambda x: (x[0], x[1]))
  rules = cli_common.rule_generation_configs(args, dinfer_jax.load().path)
  assert [g.gen_length for g in rules] == [32] and rules[0].block_length == 8
  # a flag given on the command line still wins over the rule
  args = p.parse_args(["serve", "--gen-length", "16"])
  assert [g.gen_length for g in cli_common.rule_generation_configs(args, dinfer_jax.load().path)] == [16]
