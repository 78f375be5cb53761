"""Continuous batching's engine side (engine.slots): rows that join a running slot batch at block
boundaries, leave when done and shrink or grow its batch bucket still give exactly the answer (tokens,
forwards) of their prompt run alone, in every cache mode and with smoothing, vicinity and sampling."""
import jax
import numpy as np
import pytest

import dinfer_jax
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.slots import SlotPool, seed_key

# Arrival schedule: block call -> prompts joining before it. Rows 0, 1 start together; 2 joins while they
# run; 3 and 4 join together (the bucket grows to 4); 5 joins after others left (it shrinks again).
ARRIVALS = {0: [0, 1], 1: [2], 2: [3, 4], 4: [5]}
LENGTHS = (5, 9, 12, 3, 14, 7)  # ragged, one prompt bucket (16)

CONFIGS = {
    "dual": dict(cache="dual"),
    "smoothing_vicinity_sampling": dict(cache="dual", cont_weight=0.3, prefix_look=4, after_look=4,
                                        warmup_steps=1, temperature=0.7),
    "none": pytest.param(dict(cache="none"), marks=pytest.mark.slow),
    "prefix": pytest.param(dict(cache="prefix"), marks=pytest.mark.slow),
    "credit": pytest.param(dict(cache="dual", decoder="credit"), marks=pytest.mark.slow),
}


def _run_staggered(pool, prompts, seeds):
  got, calls, buckets = {}, 0, []
  while len(got) < len(prompts):
    for i in ARRIVALS.get(calls, []):
      pool.add(i, prompts[i], seeds[i])
    buckets.append(pool.bucket())
    finished, progress, counts = pool.step()
    for f in finished:
      got[f.owner] = f
    for owner, toks in progress:  # a running row's tokens so far are a prefix of its answer
      assert owner not in got
    calls += 1
    assert calls < 40
  return got, buckets


@pytest.mark.parametrize("extra", list(CONFIGS.values()), ids=list(CONFIGS))
def test_staggered_rows_equal_their_prompt_alone(model_a, extra):
  params, mcfg = model_a
  g = GenerationConfig(gen_length=24, block_length=8, threshold=0.9, prompt_bucket=16, **extra)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(5, 200, size=n).tolist() for n in LENGTHS]
  seeds = [100 + i for i in range(len(prompts))]
  got, buckets = _run_staggered(SlotPool(params, mcfg, g, prompts[0]), prompts, seeds)
  for i, p in enumerate(prompts):
    alone = dinfer_jax.generate(model_a, [p], g, seed=seeds[i])
    assert (got[i].tokens, got[i].row_nfe, got[i].gen_length) == \
        (alone.tokens[0], alone.row_nfe[0], len(alone.canvas[0]) - len(p)), i
  assert max(buckets) == 4 and buckets[0] == 2  # the batch grew with arrivals


def test_rows_leave_and_the_batch_shrinks(model_a):
  """A row that ends early (EOS in its first block) leaves at once; a removed row (a cancelled request)
  takes no further part; the others' answers do not change."""
  params, mcfg = model_a
  g = GenerationConfig(gen_length=24, block_length=8, threshold=0.9, prompt_bucket=16, cache="dual")
  rng = np.random.default_rng(1)
  prompts = [rng.integers(5, 200, size=n).tolist() for n in (6, 11, 4)]
  pool = SlotPool(params, mcfg, g, prompts[0])
  for i, p in enumerate(prompts):
    pool.add(i, p)
  finished, progress, _ = pool.step()
  assert pool.bucket() == 4 and {o for o, _ in progress} | {f.owner for f in finished} == {0, 1, 2}
  pool.remove(lambda owner: owner == 1)
  got = {f.owner: f for f in finished}
  while pool.active:
    finished, progress, _ = pool.step()
    assert 1 not in {o for o, _ in progress} | {f.owner for f in finished}
    got.update({f.owner: f for f in finished})
  assert set(got) == {0, 2}
  for i in (0, 2):
    assert got[i].tokens == dinfer_jax.generate(model_a, [prompts[i]], g).tokens[0]
  pool.drain()
  assert pool.state is None and pool.rows == []  # an empty pool holds no device state


def test_a_prompt_of_another_geometry_is_refused(model_a):
  params, mcfg = model_a
  g = GenerationConfig(gen_length=16, block_length=8, prompt_bucket=16, cache="dual")
  pool = SlotPool(params, mcfg, g, [5] * 4)
  assert SlotPool.key(mcfg, g, [5] * 4) == SlotPool.key(mcfg, g, [6] * 15)
  assert SlotPool.key(mcfg, g, [5] * 4) != SlotPool.key(mcfg, g, [5] * 17)
  with pytest.raises(ValueError, match="17 tokens has another canvas geometry"):
    pool.add("x", [5] * 17)


def test_seed_keys_are_the_keys_jax_makes():
  for seed in (0, 1, 7, 2**31 - 1, 2**31, 2**32 + 5, 2**63 - 1, -1, -5, -(2**63)):
    assert np.array_equal(seed_key(seed), np.asarray(jax.random.PRNGKey(seed))), seed


def test_slots_are_bounded(model_a):
  params, mcfg = model_a
  g = GenerationConfig(gen_length=16, block_length=8, prompt_bucket=16, cache="dual")
  pool = SlotPool(params, mcfg, g, [5] * 4, capacity=2)
  pool.add(0, [5] * 4)
  pool.add(1, [6] * 4)
  with pytest.raises(ValueError, match="all 2 slots are taken"):
    pool.add(2, [7] * 4)
  with pytest.raises(ValueError, match="batch bucket 1 cannot hold the 2 rows"):
    pool.step(1)


@pytest.mark.parametrize("decoder", ["threshold", pytest.param("joint_threshold", marks=pytest.mark.slow)])
def test_block_diffusion_rows_keep_their_cache_across_calls(model_llada2, decoder):
  """LLaDA2 block diffusion in slots: each row's K/V stay in the pool's state across calls, a row that joins
  has its prompt prefilled in the call that starts it, and the cross-block update rewrites its last block's
  K/V: its tokens and forwards equal the prompt run alone (prefill included)."""
  params, mcfg = model_llada2
  knobs = dict(threshold=0.5, edit_threshold=0.9, max_post_steps=2) if decoder == "joint_threshold" else dict(threshold=0.6)
  g = GenerationConfig(gen_length=24, block_length=8, prompt_bucket=16, cache="dual",
                       decoder=decoder, **knobs)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(5, 200, size=n).tolist() for n in LENGTHS]  # their first blocks start at 0 and at 8
  got, buckets = _run_staggered(SlotPool(params, mcfg, g, prompts[0]), prompts, [0] * len(prompts))
  for i, p in enumerate(prompts):
    alone = dinfer_jax.generate(model_llada2, [p], g)
    assert (got[i].tokens, got[i].row_nfe) == (alone.tokens[0], alone.row_nfe[0]), i
  assert max(buckets) >= 4  # rows ran together, joining and leaving at block boundaries
