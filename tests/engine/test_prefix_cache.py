"""Block diffusion's prefix cache across requests (engine.prefix_cache): the radix tree's hits, pages, LRU
and widths worked by hand, and rows that reuse other requests' prompt blocks answering exactly as alone, with
evictions on the way, their reused K/V equal to a prefill's."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dinfer_jax
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.prefix_cache import INITIAL_PAGES, PrefixStore, gather_blocks, scatter_blocks
from dinfer_jax.engine.slots import SlotPool

L = 4
TINY = types.SimpleNamespace(n_layers=2, n_kv_heads=1, head_dim=2)
PAGE = 2 * 2 * L * 1 * 2 * 4  # n_layers * (K, V) * L * K * H * fp32 bytes


def _store(pages):
  return PrefixStore(TINY, L, jnp.float32, pages * PAGE)


def _blocks(*rows):
  return [tuple(r) for r in rows]


A0, A1, A2, B0 = (1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9), (1, 2, 3, 5)


def test_hits_are_whole_blocks_matched_exactly_from_the_first():
  s = _store(8)
  # C = 16: pad block 0, prompt blocks at canvas blocks 1..3; nothing cached: all miss, 3 missing -> width 4 blocks
  p = s.plan(_blocks(A0, A1, A2), 1, 16)
  assert (p.hit, p.width) == (0, 16)
  assert p.read.tolist() == [0, 0, 0, 0] and p.write.tolist() == [0, 1, 2, 3]  # page 0: the sink
  p = s.plan(_blocks(A0, A1, A2), 1, 16)
  assert (p.hit, p.width) == (3, 0) and p.read.tolist() == [0, 1, 2, 3] and p.write.tolist() == [0] * 4
  # Same first block, second differs: one hit; the two missing blocks are a width of 2 blocks.
  p = s.plan(_blocks(A0, A2, A1), 1, 16)
  assert (p.hit, p.width) == (1, 8) and p.read.tolist() == [0, 1, 0, 0] and p.write.tolist() == [0, 0, 4, 5]
  # One token off in the first block: no hit (keys are the tokens, not a hash); pads only before: 3 missing.
  p = s.plan(_blocks(B0), 3, 16)
  assert (p.hit, p.width) == (0, 4) and p.write.tolist() == [0, 0, 0, 6]
  assert (s.stats.hit_blocks, s.stats.miss_blocks, s.stats.stored_blocks, s.stats.prefills_saved) == (4, 6, 6, 1)
  s.check()
  with pytest.raises(ValueError, match="do not fill the 4 blocks"):
    s.plan(_blocks(A0), 1, 16)


def test_lru_evicts_leaves_never_the_rows_own_path():
  s = _store(3)
  s.plan(_blocks(A0, A1), 0, 8)  # pages 1, 2
  s.plan(_blocks(B0), 1, 8)  # page 3: full
  s.plan(_blocks(B0), 1, 8)  # B0 touched: A's chain is least recent, A1 its leaf
  p = s.plan(_blocks(A2), 1, 8)  # evicts A1 (a leaf), not A0 (its parent, as old but inner)
  assert p.write.tolist() == [0, 2] and s.stats.evicted_blocks == 1
  assert s.plan(_blocks(A0, A1), 0, 8).hit == 1
  s.check()
  # A row longer than the budget keeps what fits: its own blocks are never evicted for its later ones.
  s = _store(2)
  p = s.plan(_blocks(A0, A1, A2), 0, 12)
  assert p.write.tolist() == [1, 2, 0] and s.stats.evicted_blocks == 0
  assert s.plan(_blocks(A0, A1, A2), 0, 12).hit == 2
  s.check()


def test_the_buffer_grows_to_the_budget_and_no_further():
  s = _store(INITIAL_PAGES * 2 + 3)
  assert s.pages.shape[0] == INITIAL_PAGES + 1
  for i in range(INITIAL_PAGES * 2 + 5):
    s.plan(_blocks((100 + i,) * L), 0, L)
  assert s.pages.shape[0] == INITIAL_PAGES * 2 + 3 + 1 and s.stats.evicted_blocks == 2
  assert s.used_bytes == (INITIAL_PAGES * 2 + 3) * PAGE
  s.check()
  with pytest.raises(ValueError, match="holds no block"):
    PrefixStore(TINY, L, jnp.float32, PAGE - 1)


def test_gather_is_the_inverse_of_scatter():
  rng = np.random.default_rng(0)
  k = tuple(jnp.asarray(rng.normal(size=(1, 3 * L, 1, 2)), jnp.float32) for _ in range(2))
  v = tuple(jnp.asarray(rng.normal(size=(1, 3 * L, 1, 2)), jnp.float32) for _ in range(2))
  pages = scatter_blocks(jnp.zeros((5,) + (2, 2, L, 1, 2)), jnp.asarray([3, 1, 4]), k, v)
  gk, gv = gather_blocks(pages, jnp.asarray([3, 1, 4]))
  for a, b in zip(gk + gv, k + v):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(pages[1, 0, 0], k[0][0, L:2 * L])  # block 1 of layer 0's K on page 1


SYSTEM = 19  # tokens of the shared system prompt: two whole blocks of 8, then 3 in the first decoding block


@pytest.mark.parametrize("budget_pages", [3, pytest.param(64, marks=pytest.mark.slow)])
def test_rows_reusing_prompt_blocks_answer_as_alone(model_llada2, budget_pages):
  """Requests sharing a system prompt, joining a running pool at staggered calls: each row's tokens equal the
  prompt run alone. Every prompt's first two blocks are the system prompt's; prompts of 24 tokens or more have
  a third whole block of their own. So after the first row, each row hits 2 blocks, and the rows with only
  those two (2 and 5; 0 came first) skip their prefill: one forward fewer than alone, the others the same.
  With a budget of 3 blocks, rows 3 and 4 each evict the last row's third block."""
  params, mcfg = model_llada2
  g = GenerationConfig(gen_length=16, block_length=8, prompt_bucket=16, cache="dual", threshold=0.6)
  rng = np.random.default_rng(3)
  system = rng.integers(5, 200, size=SYSTEM).tolist()
  tails = [3, 12, 2, 5, 9, 4]  # 22, 31, 21, 24, 28, 23 tokens: one canvas geometry (C = 32)
  prompts = [system + rng.integers(5, 200, size=n).tolist() for n in tails]
  dt = params["embed"].dtype
  store = PrefixStore(mcfg, 8, dt, budget_pages * PrefixStore(mcfg, 8, dt, 1 << 30).page_bytes)
  pool = SlotPool(params, mcfg, g, prompts[0], prefix_store=store)
  arrivals = {0: [0], 1: [1, 2], 2: [3], 4: [4, 5]}
  got, calls = {}, 0
  while len(got) < len(prompts):
    for i in arrivals.get(calls, []):
      pool.add(i, prompts[i])
    finished, _, _ = pool.step()
    got.update({f.owner: f for f in finished})
    calls += 1
    assert calls < 30
  store.check()
  for i, p in enumerate(prompts):
    alone = dinfer_jax.generate(model_llada2, [p], g)
    assert got[i].tokens == alone.tokens[0], i
    assert alone.row_nfe[0] - got[i].row_nfe == (1 if i in (2, 5) else 0), i
  st = store.stats
  assert (st.hit_blocks, st.miss_blocks, st.prefills_saved) == (10, 5, 2)
  assert st.evicted_blocks == (0 if budget_pages == 64 else 2)


def test_reused_kv_equals_the_prefill(model_llada2):
  """The prompt K/V a row starts its first block with, from the store (a full hit) and from the step's own
  prefill, agree to fp32 rounding."""
  params, mcfg = model_llada2
  g = GenerationConfig(gen_length=8, block_length=8, prompt_bucket=16, cache="dual", threshold=0.6)
  rng = np.random.default_rng(4)
  p = rng.integers(5, 200, size=21).tolist()  # canvas blocks 2, 3 hold the prompt's whole blocks (pad 16)
  store = PrefixStore(mcfg, 8, params["embed"].dtype, 1 << 22)
  caches = []
  for ps in (None, store, store):
    pool = SlotPool(params, mcfg, g, p, prefix_store=ps)
    pool.add(0, p)
    pool.step()
    caches.append(jax.tree_util.tree_map(lambda a: np.asarray(a[0, 16:32]), pool.state.cache))
  assert store.stats.prefills_saved == 1
  for ref, cold, hit in zip(*(jax.tree_util.tree_leaves(c) for c in caches)):
    np.testing.assert_allclose(cold, ref, atol=1e-5)
    np.testing.assert_array_equal(hit, cold)
