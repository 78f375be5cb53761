"""The engine (and the reference loop) against dInfer's golden decode traces, exactly.

Every non-excluded case of tests/golden/decode/{A,dense}/traces.json: the canvas (EOS fill included),
commit_step and NFE must equal the trace (fp32, highest matmul precision: tests/conftest.py). Excluded: the
unrolled x* extras (dInfer's maximum_unroll=4 behaviour, which the engine does not copy) and the two
double-refresh cases (docs/design.md, D7).

Each engine case compiles one program (a few seconds on CPU), so the default run takes one case per
configuration and set (rotating the prompt slots); `-m slow` runs all of them.
"""
from __future__ import annotations

import pytest

from dinfer_jax.engine.generate import generate
from tests.engine.golden import DOUBLE_REFRESH, golden_cases, load_model, load_traces, trace_config
from tests.engine.reference import reference_generate

# One representative case per configuration and set for the default run (slots rotated so that early stop,
# unaligned first blocks and long runs all appear).
DEFAULT_ENGINE = {
    "A/a_thr0.9_nocache/p1", "A/b_thr0.7_nocache/p2", "A/c_thr0.9_prefix/p0", "A/d_thr0.9_dual/p2",
    "A/e_thr0.8_dual_vicinity4-4-2/p2", "A/f1_hier0.9-0.5_nocache/p1", "A/f2_hier0.9-0.5_dual/p0",
    "A/g_credit_thr0.9_nocache/p1", "A/h1_itersmooth0.3_thr0.9_nocache/p0",
    "A/h2_itersmooth0.3_thr0.9_dual_vicinity4-4-2/p2", "A/i_thr0.9_nocache_align_false/p0",
    "dense/a_thr0.9_nocache/p0", "dense/b_thr0.7_nocache/p1", "dense/c_thr0.9_prefix/p1",
    "dense/d_thr0.9_dual/p0", "dense/f1_hier0.9-0.5_nocache/p2", "dense/f2_hier0.9-0.5_dual/p1",
    "dense/i_thr0.9_nocache_align_false/p1",
}
# The reference loop on a few cheap traces in the default run (credit, vicinity + smoothing, dense dual cache).
# (test_engine_vs_reference.py exercises it much more; -m slow checks it on every trace.)
DEFAULT_REFERENCE = {
    "A/g_credit_thr0.9_nocache/p2", "A/h2_itersmooth0.3_thr0.9_dual_vicinity4-4-2/p2", "dense/d_thr0.9_dual/p0",
}

CASES = golden_cases("A") + golden_cases("dense")
KINDS = {"full": "full", "refresh": "full_refresh", "cached": "cached"}


def _params(default: set[str]):
  return [pytest.param(c, id=c["name"], marks=() if c["name"] in default else pytest.mark.slow) for c in CASES]


def test_case_selection():
  """52 comparable traces; every default case exists; every configuration of a set is in the default run."""
  names = {c["name"] for c in CASES}
  assert len(CASES) == 52
  assert DEFAULT_ENGINE <= names and DEFAULT_REFERENCE <= names
  configs = {(c["name"].split("/")[0], c["config_name"]) for c in CASES}
  assert {tuple(n.split("/")[:2]) for n in DEFAULT_ENGINE} == configs


@pytest.mark.parametrize("case", _params(DEFAULT_ENGINE))
def test_engine_matches_trace(case):
  params, cfg = load_model(case["name"].split("/")[0])
  res = generate((params, cfg), [case["prompt_ids"]], trace_config(case), seed=0)
  P = case["prompt_length"]
  assert res.prompt_lengths == [P]
  assert res.canvas[0] == case["canvas"]
  assert res.commit_step[0] == case["commit_step"]
  assert res.nfe == case["num_forwards"]
  assert res.row_nfe == [case["num_forwards"]]
  assert sum(res.forward_counts.values()) == case["num_forwards"]
  assert res.forward_counts["cached"] == sum(f["kind"] == "cached" for f in case["forwards"])
  # What a user reads: the generated tokens before the first EOS.
  gen = case["generated_tokens"]
  k = gen.index(case["config"]["eos_id"]) if case["config"]["eos_id"] in gen else len(gen)
  assert res.tokens[0] == gen[:k] and res.num_tokens == [k]


@pytest.mark.parametrize("case", _params(DEFAULT_REFERENCE))
def test_reference_matches_trace(case):
  params, cfg = load_model(case["name"].split("/")[0])
  ref = reference_generate(params, cfg, case["prompt_ids"], trace_config(case))
  assert ref.canvas == case["canvas"]
  assert ref.commit_step == case["commit_step"]
  assert ref.nfe == case["num_forwards"]
  # The same forwards, in order: kind and input range.
  assert [(KINDS[k], [a, b]) for k, a, b in ref.forwards] == [(f["kind"], f["input_range"]) for f in case["forwards"]]
  assert [list(b) for b in ref.blocks] == case["blocks_visited"]


@pytest.mark.slow
@pytest.mark.parametrize("name", DOUBLE_REFRESH)
def test_double_refresh_cases_refresh_once(name):
  """Where dInfer refreshes block 1 twice (block 0 finished during the vicinity warm-up), the engine and the
  reference refresh once per block entry (docs/design.md, D7), agree with each other, and agree with the trace on
  every forward before dInfer's second refresh."""
  case = next(c for c in load_traces("A")["cases"] if c["name"] == name)
  gcfg = trace_config(case)
  params, cfg = load_model("A")
  ref = reference_generate(params, cfg, case["prompt_ids"], gcfg)
  res = generate((params, cfg), [case["prompt_ids"]], gcfg)
  assert res.canvas[0] == ref.canvas and res.commit_step[0] == ref.commit_step and res.nfe == ref.nfe
  refreshes = [blk for (kind, _, _), blk in zip(ref.forwards, ref.forward_block) if kind == "refresh"]
  assert len(refreshes) == len(set(refreshes))
  # dInfer's second refresh of a block: the trace and the engine part there.
  seen = set()
  for j, (f, d) in enumerate(zip(case["forwards"], case["decode_calls"])):
    if f["kind"] == "full_refresh":
      if tuple(d["block"]) in seen:
        break
      seen.add(tuple(d["block"]))
  else:
    raise AssertionError("no double refresh in the trace")
  assert [(KINDS[k], [a, b]) for k, a, b in ref.forwards[:j]] == [(f["kind"], f["input_range"]) for f in case["forwards"][:j]]
  P = case["prompt_length"]
  for pos, step in enumerate(case["commit_step"]):
    if 1 <= step <= j:
      assert ref.commit_step[pos] == step and ref.canvas[P + pos] == case["canvas"][P + pos]


def _without_idle_forwards(case: dict) -> tuple[list[int], int]:
  """A trace as the engine runs it by default (dinfer_compat off): dInfer's cached step after a refresh
  that committed nothing is dropped and the later forwards renumbered. Returns (commit_step, num_forwards)."""
  kinds = [f["kind"] for f in case["forwards"]]
  used = set(case["commit_step"])
  idle = {k for k in range(2, len(kinds) + 1)  # 1-based forward index
          if kinds[k - 1] == "cached" and kinds[k - 2] == "full_refresh" and k not in used}
  new_index = {}
  for k in range(1, len(kinds) + 1):
    if k not in idle:
      new_index[k] = len(new_index) + 1
  return [new_index.get(c, c) if c > 0 else c for c in case["commit_step"]], len(kinds) - len(idle)


CACHED_CASES = [c for c in CASES if c["config"]["cache"]]


def test_some_traces_have_idle_forwards():
  """What the default saves on dInfer's own traces (so the test below compares something)."""
  saved = [c["num_forwards"] - _without_idle_forwards(c)[1] for c in CACHED_CASES]
  assert sum(saved) == 9 and sum(s > 0 for s in saved) == 5, saved
  assert all(c["num_forwards"] > _without_idle_forwards(c)[1] for c in CACHED_CASES if c["name"] in DEFAULT_IDLE)


# Default run: one dual and one prefix case where dInfer's trace has an idle forward (5 traces have one).
DEFAULT_IDLE = {"A/d_thr0.9_dual/p1", "dense/c_thr0.9_prefix/p2"}


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"], marks=() if c["name"] in DEFAULT_IDLE
                                               else pytest.mark.slow) for c in CACHED_CASES])
def test_engine_without_idle_forwards_matches_trace(case):
  """Default engine (no forward that cannot commit): the same canvas, the same commit order, fewer forwards."""
  params, cfg = load_model(case["name"].split("/")[0])
  gcfg = trace_config(case).replace(dinfer_compat=False)
  res = generate((params, cfg), [case["prompt_ids"]], gcfg, seed=0)
  commit, nfe = _without_idle_forwards(case)
  assert res.canvas[0] == case["canvas"]
  assert res.commit_step[0] == commit
  assert res.nfe == nfe and res.row_nfe == [nfe]
  ref = reference_generate(params, cfg, case["prompt_ids"], gcfg)
  assert ref.canvas == case["canvas"] and ref.commit_step == commit and ref.nfe == nfe
