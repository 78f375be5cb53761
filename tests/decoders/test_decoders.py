"""Decoder rules: dInfer's worked examples, guards, batching, sampling, and numpy references."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax import decoders
from dinfer_jax.decoders import (CreditDecoder, FastDLLMDecoder, FixedStepsDecoder, HierarchyDecoder,
                                 ThresholdDecoder, propose)
from dinfer_jax.decoders import baselines, common, hierarchy
from dinfer_jax.engine.config import GenerationConfig

V = 16
MASK = V - 1
# Example blocks are padded to one length (maskable=False past their end) so that jit compiles each
# decoder once for all of them; this also exercises padding everywhere.
L_PAD = 12


def D(dec, **knobs):
  """(static decoder, its Knobs): dec a decoder class (built without arguments) or instance."""
  dec = dec() if isinstance(dec, type) else dec
  return dec, type(dec).knobs(**knobs)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("mask_id", "temperature"))
def _jstep(dec, state, logits, tokens, maskable, knobs, *, mask_id, temperature, rng):
  return dec.step(state, logits, tokens, maskable, knobs, mask_id=mask_id, temperature=temperature, rng=rng)


def jstep(dec, state, logits, tokens, maskable, *, mask_id=MASK, threshold=None, temperature=0.0, rng=None):
  """Every test goes through jit with the decoder static and its knobs traced fp32 values, as in the engine;
  dec is a D(...) pair. threshold: the step's threshold instead of the knobs' (iteration smoothing's)."""
  decoder, knobs = dec
  if threshold is not None:
    knobs = knobs.replace(threshold=threshold)
  knobs = jax.tree_util.tree_map(jnp.float32, knobs)
  return _jstep(decoder, state, logits, tokens, maskable, knobs, mask_id=mask_id, temperature=temperature, rng=rng)


@functools.partial(jax.jit, static_argnums=0)
def _jinit(dec, tokens, maskable):
  return dec.init_state(tokens, maskable)


def jinit(dec, tokens, maskable):
  """init_state under jit, decoder static."""
  return _jinit(dec[0], tokens, maskable)


_softmax_at = jax.jit(common.softmax_at)
# Eager dispatch of every op is slow on a shared CPU; jit the helper the tests call directly.
propose = jax.jit(propose, static_argnames=("mask_id", "temperature"))


def conf_logits(confs, tops, exact=()):
  """[N, V] fp32 logits whose softmax gives token tops[n] probability confs[n] (and is its argmax).

  The rest of the mass is spread evenly. Rows listed in `exact` have one other logit walked ulp by
  ulp until the decoders' own fp32 confidence equals fp32(conf) exactly, for tests on the boundary of
  >= / >. (Not every fp32 value is reachable: the argmax's confidence is fl(1 / denominator).) Exact
  ties need no walk: give the tied positions the same conf and the same top token.
  """
  confs = np.asarray(confs, np.float64)
  tops = np.asarray(tops)
  z = np.log((1 - confs) / (V - 1))[:, None].repeat(V, 1)
  z[np.arange(len(confs)), tops] = np.log(confs)
  z = z.astype(np.float32)
  rows = np.asarray(sorted(exact), int)
  if not len(rows):
    return z
  target = confs[rows].astype(np.float32)
  other = (tops[rows] + 1) % V

  def conf():
    zp = np.zeros((L_PAD, V), np.float32)
    zp[:len(z)] = z
    tp = np.zeros(L_PAD, np.int32)
    tp[:len(z)] = tops
    return np.asarray(_softmax_at(jnp.asarray(zp)[None], jnp.asarray(tp)[None]))[0][rows]

  got = conf()
  # Lowering another token's logit raises the top token's probability, and vice versa.
  direction = np.where(got < target, -np.inf, np.inf).astype(np.float32)
  for _ in range(5000):
    todo = (got != target) & ((got < target) == (direction < 0))
    if not todo.any():
      break
    z[rows[todo], other[todo]] = np.nextafter(z[rows[todo], other[todo]], direction[todo])
    got = conf()
  assert (got == target).all(), (got, target)
  return z


def block(confs, tops=None, decoded=(), exact=()):
  """One-row block from per-position confidences: logits [1, L_PAD, V], tokens, maskable [1, L_PAD].

  Positions past len(confs) are padding: MASK tokens with maskable False and flat logits.
  """
  l = len(confs)
  tops = np.arange(l) % (V - 1) if tops is None else np.asarray(tops)
  logits = np.zeros((1, L_PAD, V), np.float32)
  logits[0, :l] = conf_logits(confs, tops, exact)
  tokens = np.full((1, L_PAD), MASK, np.int32)
  for j in decoded:
    tokens[0, j] = 7
  return jnp.asarray(logits), jnp.asarray(tokens), jnp.arange(L_PAD)[None] < l


def committed_set(committed, row=0):
  return set(np.flatnonzero(np.asarray(committed)[row]).tolist())


# --- D2 threshold ---------------------------------------------------------------------------------


def test_threshold_worked_example_inclusive():
  # docs/design.md D2, threshold 0.9: [0.97, (decoded), 0.55, 0.91, 0.90, 0.30] -> {0, 3, 4}.
  logits, tokens, maskable = block([0.97, 0.5, 0.55, 0.91, 0.90, 0.30], decoded=[1], exact=[4])
  dec = D(ThresholdDecoder, threshold=0.9)
  new, committed, _ = jstep(dec, (), logits, tokens, maskable, threshold=0.9)
  assert committed_set(committed) == {0, 3, 4}  # 0.90 == threshold commits: the rule is >=
  tops = np.arange(6) % (V - 1)
  expect = np.array([tops[0], 7, MASK, tops[3], tops[4], MASK])
  np.testing.assert_array_equal(np.asarray(new)[0, :6], expect)


def test_threshold_worked_example_tie_tolerance():
  # D2: [0.62, 0.6200004, 0.40] -> tau = 0.6200004 - 1e-5 -> {0, 1}.
  logits, tokens, maskable = block([0.62, 0.6200004, 0.40])
  _, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {0, 1}
  # Just outside the 1e-5 tolerance only the best commits.
  logits, tokens, maskable = block([0.62, 0.62002, 0.40])
  _, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {1}


def test_threshold_uses_step_threshold_not_own():
  logits, tokens, maskable = block([0.97, 0.93, 0.80])
  dec = D(ThresholdDecoder, threshold=0.9)
  assert committed_set(jstep(dec, (), logits, tokens, maskable, threshold=0.9)[1]) == {0, 1}
  # Iteration smoothing passes a higher threshold: only the best (and its 1e-5 ties) remain.
  assert committed_set(jstep(dec, (), logits, tokens, maskable, threshold=0.98)[1]) == {0}
  assert committed_set(jstep(dec, (), logits, tokens, maskable, threshold=0.8)[1]) == {0, 1, 2}


def test_threshold_excludes_mask_argmax():
  # Position 0's argmax is MASK with 0.99: never a candidate; position 1 commits as the row's best.
  logits, tokens, maskable = block([0.99, 0.5, 0.3], tops=[MASK, 2, 3])
  _, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {1}


def test_threshold_ignores_decoded_and_padding():
  logits, tokens, maskable = block([0.95, 0.95, 0.95, 0.95], decoded=[0])
  maskable = maskable.at[0, 3].set(False)
  new, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {1, 2}
  assert int(new[0, 0]) == 7 and int(new[0, 3]) == MASK


# --- stall guard / never write MASK --------------------------------------------------------------


def _all_mask_argmax(b=2, l=5, seed=0):
  """Every position's argmax is MASK; the best non-mask token differs per position."""
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(b, l, V)).astype(np.float32)
  z[..., MASK] = 10.0
  return jnp.asarray(z), jnp.full((b, l), MASK, jnp.int32), jnp.ones((b, l), bool)


def test_threshold_stall_guard_commits_one_non_mask_per_row():
  logits, tokens, maskable = _all_mask_argmax()
  tokens = tokens.at[1, 0].set(3)  # a decoded position must not be picked
  new, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), logits, tokens, maskable)
  committed, new, z = np.asarray(committed), np.asarray(new), np.asarray(logits)
  np.testing.assert_array_equal(committed.sum(-1), [1, 1])
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  p_alt = np.where(np.arange(V) == MASK, -1, p)
  alt_tok, alt_conf = p_alt.argmax(-1), p_alt.max(-1)
  alt_conf[1, 0] = -1
  for b in range(2):
    j = int(alt_conf[b].argmax())
    assert committed[b, j] and new[b, j] == alt_tok[b, j] != MASK
  # A row with no masks commits nothing.
  _, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), logits, jnp.zeros_like(tokens), maskable)
  assert not np.asarray(committed).any()


@pytest.mark.parametrize("dec", [D(ThresholdDecoder, threshold=0.9),
                                 D(HierarchyDecoder, threshold=0.9, low_threshold=0.4),
                                 D(FastDLLMDecoder, threshold=0.9), D(FixedStepsDecoder(2)),
                                 D(CreditDecoder(vocab_size=V), threshold=0.9)], ids=lambda d: type(d[0]).__name__)
def test_never_commits_mask_and_always_progresses(dec):
  logits, tokens, maskable = _all_mask_argmax()
  new, committed, _ = jstep(dec, jinit(dec, tokens, maskable), logits, tokens, maskable)
  new, committed = np.asarray(new), np.asarray(committed)
  assert (committed.sum(-1) >= 1).all()
  assert (new[committed] != MASK).all()
  np.testing.assert_array_equal(new[~committed], MASK)
  if isinstance(dec[0], ThresholdDecoder):
    np.testing.assert_array_equal(committed.sum(-1), 1)


# --- D3 hierarchy ---------------------------------------------------------------------------------


def test_hierarchy_worked_example_five_iterations():
  # docs/design.md D3, low 0.4, high 0.9; fresh confidences each iteration (decoded slots: filler).
  iters = [
      [.30, .55, .42, .20, .65, .35, .50, .25],
      [.35, .60, .45, .30, .20, .45, .70, .30],
      [.80, .20, .50, .35, .20, .30, .20, .95],
      [.20, .20, .20, .38, .20, .33, .20, .20],
      [.20, .20, .20, .20, .20, .50, .20, .20],
  ]
  expected = [{4}, {1, 6}, {0, 2, 7}, {3}, {5}]
  dec = D(HierarchyDecoder, threshold=0.9, low_threshold=0.4)
  _, tokens, maskable = block(iters[0])
  for confs, want in zip(iters, expected):
    logits, _, _ = block(confs, tops=np.arange(8))
    tokens, committed, _ = jstep(dec, (), logits, tokens, maskable)
    assert committed_set(committed) == want
  np.testing.assert_array_equal(np.asarray(tokens)[0, :8], np.arange(8))


def test_hierarchy_strict_thresholds_and_ties():
  # Runs: [0, 1] | decoded 2 | [3, 4] | decoded 5 | [6, 7, 8].
  confs = [.93, .90, .5, .40, .30, .5, .60, .60, .20]
  logits, tokens, maskable = block(confs, tops=[1, 2, 3, 4, 5, 6, 7, 7, 8], decoded=[2, 5], exact=[1, 3])
  _, committed, _ = jstep(D(HierarchyDecoder, threshold=0.9, low_threshold=0.4), (), logits, tokens, maskable)
  # pos 1 == 0.9 is not > high; run [3, 4]'s max 0.40 is not > low; run [6..8] has an exact tie.
  assert committed_set(committed) == {0, 6, 7}
  # The same row with a threshold decoder: >= threshold takes pos 1 too.
  _, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {0, 1}


def test_hierarchy_runs_bounded_by_padding():
  masked = jnp.asarray([[True, True, False, True, True, True, False, True]])
  np.testing.assert_array_equal(np.asarray(hierarchy.run_ids(masked))[0][np.asarray(masked)[0]],
                                [0, 0, 1, 1, 1, 2])
  # maskable=False ends a run exactly like a decoded token.
  logits, tokens, maskable = block([.5, .6, .7, .45])
  maskable = maskable.at[0, 2].set(False)
  _, committed, _ = jstep(D(HierarchyDecoder, threshold=0.9, low_threshold=0.4), (), logits, tokens, maskable)
  assert committed_set(committed) == {1, 3}


def test_hierarchy_global_argmax_first_index():
  logits, tokens, maskable = block([.3, .35, .35, .1], tops=[1, 2, 2, 3])
  _, committed, _ = jstep(D(HierarchyDecoder, threshold=0.9, low_threshold=0.4), (), logits, tokens, maskable)
  assert committed_set(committed) == {1}


# --- D4 credit -------------------------------------------------------------------------------------


def test_credit_worked_example():
  # docs/design.md D4: p = 0.5 on the same token three times -> C = 0.871, 1.567, 2.124,
  # boosts alpha*log1p(C) = 0.438, 0.660, 0.797, fused probability 0.608, 0.659, 0.689.
  # Position 1 (p = 0.95) commits every step, so position 0 is decided by its fused confidence
  # against threshold 0.68. The canvas is not written back, so position 0 stays masked.
  dec = D(CreditDecoder(vocab_size=V), threshold=0.9)  # the step threshold 0.68 is passed below
  logits, tokens, maskable = block([0.5, 0.95], tops=[4, 5])
  state = jinit(dec, tokens, maskable)
  assert float(jnp.abs(state.credit).max()) == 0 and int(state.calls) == 0
  want_c, want_boost, want_p = [0.871, 1.567, 2.124], [0.438, 0.660, 0.797], [0.608, 0.659, 0.689]
  want_sets = [{1}, {1}, {0, 1}]
  for t in range(3):
    _, committed, state = jstep(dec, state, logits, tokens, maskable, threshold=0.68)
    c = np.asarray(state.credit)[0, 0]
    assert c[4] == pytest.approx(want_c[t], abs=1e-3)
    assert np.count_nonzero(c) == 1  # only the top-1 token accumulates
    assert 0.7 * np.log1p(c[4]) == pytest.approx(want_boost[t], abs=1e-3)
    fused = np.asarray(logits)[0, 0] + 0.7 * np.log1p(c)
    p = np.exp(fused - fused.max()) / np.exp(fused - fused.max()).sum()
    assert p[4] == pytest.approx(want_p[t], abs=1e-3)
    assert committed_set(committed) == want_sets[t]
  assert int(state.calls) == 3


def test_credit_only_masked_accumulate_and_reset():
  dec = D(CreditDecoder(vocab_size=V), threshold=0.9)
  logits, tokens, maskable = block([0.5, 0.6, 0.7], decoded=[1])
  maskable = maskable.at[0, 2].set(False)
  _, _, state = jstep(dec, jinit(dec, tokens, maskable), logits, tokens, maskable)
  c = np.asarray(state.credit)[0]
  assert c[0].sum() > 0 and c[1].sum() == 0 and c[2].sum() == 0
  fresh = jinit(dec, tokens, maskable)
  assert np.asarray(fresh.credit).sum() == 0 and int(fresh.calls) == 0


def test_credit_can_flip_argmax():
  # Token 4 was top-1 for two steps; now token 6 leads narrowly and the credit keeps token 4.
  dec = D(CreditDecoder(vocab_size=V), threshold=0.9)
  tokens, maskable = jnp.full((1, 1), MASK, jnp.int32), jnp.ones((1, 1), bool)
  base = np.zeros((1, 1, V), np.float32)
  early = base.copy()
  early[..., 4] = 3.0
  late = base.copy()
  late[..., 4], late[..., 6] = 3.0, 3.1
  nothing = jnp.zeros_like(maskable)
  state = jinit(dec, tokens, nothing)
  _, _, state = jstep(dec, state, jnp.asarray(early), tokens, nothing, threshold=0.99)
  assert np.asarray(state.credit).sum() == 0  # positions outside the block never accumulate
  state = jinit(dec, tokens, maskable)
  # Not written back, so the position stays masked and keeps accumulating.
  for _ in range(2):
    _, _, state = jstep(dec, state, jnp.asarray(early), tokens, maskable, threshold=0.99)
  new, _, _ = jstep(dec, state, jnp.asarray(late), tokens, maskable, threshold=0.99)
  assert int(new[0, 0]) == 4
  new, _, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), jnp.asarray(late), tokens, maskable, threshold=0.99)
  assert int(new[0, 0]) == 6


# --- D5 fixed steps, Fast-dLLM -------------------------------------------------------------------


@pytest.mark.parametrize("m,s,want", [(10, 4, [3, 3, 2, 2]), (2, 4, [1, 1, 0, 0]), (8, 4, [2, 2, 2, 2]),
                                      (0, 3, [0, 0, 0])])
def test_fixed_steps_schedule(m, s, want):
  got = [int(baselines.num_transfer_tokens(jnp.asarray([m]), jnp.int32(i), s)[0]) for i in range(s + 2)]
  assert got == want + [0, 0]  # past S: nothing


def test_fixed_steps_decoder_runs_block_to_completion():
  rng = np.random.default_rng(1)
  l, s = 12, 4
  dec = D(FixedStepsDecoder(s))
  tokens = np.full((2, l), MASK, np.int32)
  tokens[0, :2] = 3  # row 0: an aligned first block overlapping the prompt -> m = 10
  tokens = jnp.asarray(tokens)
  maskable = jnp.ones((2, l), bool).at[1, 10:].set(False)  # row 1: m = 10 (padding past the canvas)
  state = jinit(dec, tokens, maskable)
  counts = []
  while bool(((tokens == MASK) & maskable).any()):
    logits = jnp.asarray(rng.normal(size=(2, l, V)).astype(np.float32))
    prop = propose(logits, mask_id=MASK)
    before = np.asarray((tokens == MASK) & maskable)
    tokens, committed, state = jstep(dec, state, logits, tokens, maskable)
    committed = np.asarray(committed)
    counts.append(committed.sum(-1).tolist())
    # Top-n by confidence among the masked positions.
    conf = np.where(before, np.asarray(prop.conf), -np.inf)
    for b in range(2):
      n = committed[b].sum()
      if n:
        assert conf[b][committed[b]].min() >= conf[b][before[b] & ~committed[b]].max(initial=-np.inf)
    assert len(counts) <= s
  assert counts == [[3, 3], [3, 3], [2, 2], [2, 2]]
  # Schedule exhausted: further calls commit nothing.
  logits = jnp.asarray(rng.normal(size=(2, l, V)).astype(np.float32))
  _, committed, _ = jstep(dec, state, logits, tokens.at[:, 5].set(MASK), maskable)
  assert not np.asarray(committed).any()


def test_fixed_steps_ties_lower_index():
  logits, tokens, maskable = block([.5, .5, .5, .5, .5, .5], tops=[2] * 6)
  dec = D(FixedStepsDecoder(3))
  _, committed, state = jstep(dec, jinit(dec, tokens, maskable), logits, tokens, maskable)
  assert committed_set(committed) == {0, 1}
  assert int(state.num_masked[0]) == 6


def test_fastdllm_top1_plus_threshold():
  logits, tokens, maskable = block([.5, .3, .95, .90, .89], exact=[3])
  _, committed, _ = jstep(D(FastDLLMDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {2, 3}  # >= threshold, inclusive
  logits, tokens, maskable = block([.5, .6, .6000004, .2])
  _, committed, _ = jstep(D(FastDLLMDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {2}  # top-1 only, no 1e-5 tolerance (dInfer would take {1, 2})
  _, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {1, 2}
  logits, tokens, maskable = block([.5, .6, .6, .2], tops=[1, 2, 2, 3])
  _, committed, _ = jstep(D(FastDLLMDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {1}  # exact tie: lower index
  # x0 == MASK is not excluded, but MASK is never written.
  logits, tokens, maskable = block([.95, .3], tops=[MASK, 2])
  new, committed, _ = jstep(D(FastDLLMDecoder, threshold=0.9), (), logits, tokens, maskable)
  assert committed_set(committed) == {0} and int(new[0, 0]) != MASK


# --- batching ------------------------------------------------------------------------------------


def _random_case(seed, b=3, l=10):
  rng = np.random.default_rng(seed)
  z = (rng.normal(size=(b, l, V)) * rng.uniform(0.5, 4.0)).astype(np.float32)
  z[rng.random((b, l)) < 0.15, MASK] = 50.0  # argmax MASK
  for _ in range(3):  # exact duplicate rows -> exact confidence ties
    bb, j = rng.integers(b), rng.integers(l - 1)
    z[bb, j + 1] = z[bb, j]
  tokens = np.where(rng.random((b, l)) < 0.7, MASK, rng.integers(0, MASK, (b, l))).astype(np.int32)
  maskable = np.ones((b, l), bool)
  maskable[0, l - rng.integers(0, 4):] = False
  return z, tokens, maskable


ALL_DECODERS = [D(ThresholdDecoder, threshold=0.7), D(HierarchyDecoder, threshold=0.8, low_threshold=0.3),
                D(FastDLLMDecoder, threshold=0.6), D(FixedStepsDecoder(3)), D(CreditDecoder(vocab_size=V), threshold=0.7)]


@pytest.mark.parametrize("dec", ALL_DECODERS, ids=lambda d: type(d[0]).__name__)
def test_rows_independent(dec):
  """Each row of a batch-3 run equals that row run alone, over two steps (so state is carried)."""
  z, tokens, maskable = (jnp.asarray(a) for a in _random_case(3))
  alone = []
  for b in range(3):
    t_b, m_b = tokens[b:b + 1], maskable[b:b + 1]
    s_b, outs = jinit(dec, t_b, m_b), []
    for _ in range(2):
      t_b, c_b, s_b = jstep(dec, s_b, z[b:b + 1], t_b, m_b)
      outs.append((np.asarray(t_b)[0], np.asarray(c_b)[0]))
    alone.append(outs)
  t_all, state = tokens, jinit(dec, tokens, maskable)
  for step in range(2):
    t_all, c_all, state = jstep(dec, state, z, t_all, maskable)
    assert np.asarray(c_all).any()
    for b in range(3):
      np.testing.assert_array_equal(np.asarray(t_all)[b], alone[b][step][0])
      np.testing.assert_array_equal(np.asarray(c_all)[b], alone[b][step][1])


@pytest.mark.parametrize("dec", ALL_DECODERS, ids=lambda d: type(d[0]).__name__)
def test_block_loop_in_while_loop_terminates(dec):
  """The engine's on-device loop: state carries through lax.while_loop and every block finishes.

  Half the positions have MASK as their argmax, so only the guards keep some rows moving.
  """
  z, _, _ = _random_case(7, b=3, l=10)
  z[:, ::2, MASK] = 60.0
  z = jnp.asarray(z)
  tokens = jnp.full((3, 10), MASK, jnp.int32)
  maskable = jnp.ones((3, 10), bool).at[2, 7:].set(False)

  @functools.partial(jax.jit, static_argnums=0)
  def run_block(dec, knobs, tokens):
    def cond(carry):
      tokens, _, n = carry
      return jnp.any((tokens == MASK) & maskable) & (n < 50)

    def body(carry):
      tokens, state, n = carry
      tokens, _, state = dec.step(state, z, tokens, maskable, knobs.replace(threshold=jnp.float32(0.9)),
                                  mask_id=MASK, temperature=0.0, rng=None)
      return tokens, state, n + 1

    return jax.lax.while_loop(cond, body, (tokens, dec.init_state(tokens, maskable), jnp.int32(0)))

  out, _, n = run_block(dec[0], jax.tree_util.tree_map(jnp.float32, dec[1]), tokens)
  out = np.asarray(out)
  assert int(n) <= 10
  assert (out[np.asarray(maskable)] != MASK).all()
  np.testing.assert_array_equal(out[2, 7:], MASK)  # padding is never written


# --- sampling ------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_and_ignores_rng():
  z, tokens, maskable = (jnp.asarray(a) for a in _random_case(4))
  p = propose(z, mask_id=MASK)
  np.testing.assert_array_equal(np.asarray(p.token), np.asarray(z).argmax(-1))
  dec = D(HierarchyDecoder, threshold=0.8, low_threshold=0.3)
  a = jstep(dec, (), z, tokens, maskable, rng=jax.random.key(0))
  b = jstep(dec, (), z, tokens, maskable, rng=jax.random.key(1))
  c = jstep(dec, (), z, tokens, maskable)
  for x, y in ((a, b), (a, c)):
    np.testing.assert_array_equal(np.asarray(x[0]), np.asarray(y[0]))


def test_temperature_seeded_and_confidence_untempered():
  rng = np.random.default_rng(5)
  z = jnp.asarray(rng.normal(size=(2, 8, V)).astype(np.float32))
  p1 = propose(z, mask_id=MASK, temperature=1.5, rng=jax.random.key(7))
  p2 = propose(z, mask_id=MASK, temperature=1.5, rng=jax.random.key(7))
  np.testing.assert_array_equal(np.asarray(p1.token), np.asarray(p2.token))
  others = [np.asarray(propose(z, mask_id=MASK, temperature=1.5, rng=jax.random.key(s)).token)
            for s in range(8, 12)]
  assert any((o != np.asarray(p1.token)).any() for o in others)
  # Sampling moved some tokens away from the argmax, yet confidence is the plain softmax of the token.
  assert (np.asarray(p1.token) != np.asarray(z).argmax(-1)).any()
  zn = np.asarray(z, np.float64)
  sm = np.exp(zn - zn.max(-1, keepdims=True))
  sm /= sm.sum(-1, keepdims=True)
  want = np.take_along_axis(sm, np.asarray(p1.token)[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(p1.conf), want, rtol=1e-5)
  assert (np.asarray(p1.alt_token) != MASK).all()
  # Through a decoder under jit: same key, same result.
  tokens, maskable = jnp.full((2, 8), MASK, jnp.int32), jnp.ones((2, 8), bool)
  dec = D(ThresholdDecoder, threshold=0.9)
  a = jstep(dec, (), z, tokens, maskable, threshold=0.5, temperature=1.5, rng=jax.random.key(3))
  b = jstep(dec, (), z, tokens, maskable, threshold=0.5, temperature=1.5, rng=jax.random.key(3))
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  with pytest.raises(ValueError, match="rng"):
    jstep(dec, (), z, tokens, maskable, temperature=1.0)


def test_per_row_keys_make_sampling_batch_independent():
  rng = np.random.default_rng(6)
  z = jnp.asarray(rng.normal(size=(3, 8, V)).astype(np.float32))
  keys = jax.random.split(jax.random.key(0), 3)
  full = propose(z, mask_id=MASK, temperature=1.0, rng=keys)
  for b in range(3):
    alone = propose(z[b:b + 1], mask_id=MASK, temperature=1.0, rng=keys[b:b + 1])
    np.testing.assert_array_equal(np.asarray(full.token)[b], np.asarray(alone.token)[0])


# --- numpy references on random logits -----------------------------------------------------------


def _np_proposal(z):
  """x0, best non-MASK token, and fp64 confidences (checked against the fp32 ones to 1e-5)."""
  zn = z.astype(np.float64)
  sm = np.exp(zn - zn.max(-1, keepdims=True))
  sm /= sm.sum(-1, keepdims=True)
  x0 = z.argmax(-1)
  alt = np.where(np.arange(V) == MASK, -np.inf, z).argmax(-1)
  take = lambda t: np.take_along_axis(sm, t[..., None], -1)[..., 0]
  return x0, alt, take(x0), take(alt)


def ref_threshold(x0, alt, conf, alt_conf, masked, thr):
  """dInfer's threshold rule (D2) plus the stall guard, one row at a time in plain python on fp32 values."""
  b, l = x0.shape
  commit = np.zeros((b, l), bool)
  token = x0.copy()
  for r in range(b):
    cand = [j for j in range(l) if masked[r, j] and x0[r, j] != MASK]
    if cand:
      best = max(conf[r, j] for j in cand)
      tau = min(max(np.float32(best) - np.float32(1e-5), np.float32(-1000)), np.float32(thr))
      for j in cand:
        commit[r, j] = conf[r, j] >= tau
    elif masked[r].any():
      j = max((j for j in range(l) if masked[r, j]), key=lambda j: (alt_conf[r, j], -j))
      commit[r, j] = True
      token[r, j] = alt[r, j]
  return commit, token


def ref_hierarchy(conf, masked, thr, low):
  """The hierarchical rule (D3) with explicit runs, one row at a time."""
  b, l = conf.shape
  commit = np.zeros((b, l), bool)
  for r in range(b):
    j = 0
    while j < l:
      if not masked[r, j]:
        j += 1
        continue
      k = j
      while k < l and masked[r, k]:
        k += 1
      top = max(conf[r, j:k])
      for i in range(j, k):
        if conf[r, i] == top and conf[r, i] > np.float32(low):
          commit[r, i] = True
        if conf[r, i] > np.float32(thr):
          commit[r, i] = True
      j = k
    idx = [i for i in range(l) if masked[r, i]]
    if idx:
      commit[r, max(idx, key=lambda i: (conf[r, i], -i))] = True
  return commit


def _reference_case(seed):
  """_random_case plus, for some seeds, a stalled row and a near-tie within the 1e-5 tolerance."""
  z, tokens, maskable = _random_case(seed, b=3, l=12)
  if seed % 5 == 0:
    z[1, :, MASK] = 50.0  # every argmax in row 1 is MASK: the stall guard must act
  if seed % 2 == 1:
    # Row 2's best two masked positions differ by < 1e-5 in confidence: dInfer commits both.
    j = int(np.random.default_rng(seed).integers(0, 11))
    top = int(np.where(np.arange(V) == MASK, -np.inf, z[2, j]).argmax())
    z[2, j, top] = z[2, :, :MASK].max() + 0.5
    z[2, j + 1] = z[2, j]
    z[2, j + 1, top] += 2e-6
    tokens[2, j:j + 2] = MASK
  return z, tokens, maskable


def test_threshold_and_hierarchy_match_numpy_reference():
  # Fixed decoders (a recompile per seed would be slow); the threshold is the dynamic step argument.
  lows = (0.1, 0.3, 0.5)
  for seed in range(60):
    z, tokens, maskable = _reference_case(seed)
    rng = np.random.default_rng(1000 + seed)
    low = lows[seed % 3]
    thr = float(np.float32(rng.uniform(low, 0.95)))
    masked = (tokens == MASK) & maskable
    x0, alt, conf64, alt_conf64 = _np_proposal(z)
    prop = propose(jnp.asarray(z), mask_id=MASK)
    np.testing.assert_array_equal(np.asarray(prop.token), x0)
    np.testing.assert_array_equal(np.asarray(prop.alt_token), alt)
    np.testing.assert_allclose(np.asarray(prop.conf), conf64, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(prop.alt_conf), alt_conf64, rtol=1e-5)
    # The rules are compared on the decoders' own fp32 confidences, so no ulp can flip a comparison.
    conf, alt_conf = np.asarray(prop.conf), np.asarray(prop.alt_conf)
    args = (jnp.asarray(z), jnp.asarray(tokens), jnp.asarray(maskable))

    want_commit, want_token = ref_threshold(x0, alt, conf, alt_conf, masked, thr)
    new, committed, _ = jstep(D(ThresholdDecoder, threshold=0.9), (), *args, threshold=thr)
    np.testing.assert_array_equal(np.asarray(committed), want_commit, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(new), np.where(want_commit, want_token, tokens))

    want = ref_hierarchy(conf, masked, thr, low)
    new, committed, _ = jstep(D(HierarchyDecoder, threshold=1.0, low_threshold=low), (), *args, threshold=thr)
    np.testing.assert_array_equal(np.asarray(committed), want, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(new),
                                  np.where(want, np.where(x0 == MASK, alt, x0), tokens))


def test_reference_cases_exercise_edge_cases():
  """The reference comparison above is only meaningful if its cases hit the edge cases."""
  hits = dict(tie=0, near_tie=0, guard=0, multi_run=0, mask_argmax=0)
  for seed in range(60):
    z, tokens, maskable = _reference_case(seed)
    masked = (tokens == MASK) & maskable
    conf = np.asarray(propose(jnp.asarray(z), mask_id=MASK).conf)
    x0 = z.argmax(-1)
    for r in range(3):
      c = np.sort(conf[r][masked[r] & (x0[r] != MASK)])
      gaps = np.diff(c)
      hits["tie"] += int((gaps == 0).any())
      hits["near_tie"] += int(len(c) > 1 and 0 < c[-1] - c[-2] < 1e-5)  # at the row's max
      hits["guard"] += int(masked[r].any() and not (masked[r] & (x0[r] != MASK)).any())
      hits["multi_run"] += int((masked[r] & ~np.concatenate([[False], masked[r, :-1]])).sum() >= 3)
      hits["mask_argmax"] += int((masked[r] & (x0[r] == MASK)).any())
  assert all(v >= 3 for v in hits.values()), hits


# --- construction --------------------------------------------------------------------------------


def test_registry_and_validation():
  assert decoders.names()[:5] == ("threshold", "hierarchy", "credit", "fixed_steps", "fastdllm")
  assert decoders.get("hierarchy") is HierarchyDecoder
  assert decoders.from_config(GenerationConfig(threshold=0.3), vocab_size=V) == ThresholdDecoder()
  assert decoders.from_config(GenerationConfig(decoder="fixed_steps", steps_per_block=4, block_length=8),
                              vocab_size=V) == FixedStepsDecoder(4)
  cd = decoders.from_config(GenerationConfig(decoder="credit", credit_beta=0.5), vocab_size=V)
  assert cd == CreditDecoder(vocab_size=V) and hash(cd) == hash(CreditDecoder(vocab_size=V))  # no knob in it
  kn = CreditDecoder.knobs()
  assert (kn.threshold, kn.credit_alpha, kn.credit_gamma, kn.credit_beta) == (0.9, 0.7, 0.2, 0.8)
  kn = CreditDecoder.knobs_of(GenerationConfig(decoder="credit", credit_beta=0.5, threshold=0.3))
  assert (kn.threshold, kn.credit_beta) == (np.float32(0.3), np.float32(0.5))
  with pytest.raises(ValueError, match="hierarchy.*fastdllm|valid names"):
    decoders.get("nope")
  with pytest.raises(ValueError, match="'nope'"):
    decoders.get("nope")
  with pytest.raises(ValueError, match="steps"):
    ThresholdDecoder.knobs(threshold=0.9, steps=3)
  with pytest.raises(TypeError, match="vocab_size"):
    CreditDecoder()
  for bad, field in [(lambda: ThresholdDecoder.knobs(threshold=1.5), "threshold"),
                     (lambda: ThresholdDecoder.knobs(threshold=True), "threshold"),
                     (lambda: HierarchyDecoder.knobs(threshold=0.5, low_threshold=0.7), "low_threshold"),
                     (lambda: CreditDecoder.knobs(threshold=0.9, credit_beta=1.2), "credit_beta"),
                     (lambda: CreditDecoder(vocab_size=0), "vocab_size"),
                     (lambda: FixedStepsDecoder(0), "steps_per_block"),
                     (lambda: FastDLLMDecoder.knobs(threshold=float("nan")), "threshold"),
                     (lambda: GenerationConfig(decoder="credit", credit_gamma=0.0), "credit_gamma"),
                     (lambda: GenerationConfig(decoder="threshold", steps_per_block=3), "steps_per_block")]:
    with pytest.raises(ValueError, match=field):
      bad()
  with pytest.raises(ValueError, match="vocab_size"):
    dec = D(CreditDecoder(vocab_size=V + 1), threshold=0.9)
    jstep(dec, jinit(dec, jnp.full((1, 2), MASK), jnp.ones((1, 2), bool)), *block([.5, .5]))


def test_max_and_argmax_is_jnp_max_and_argmax():
  """Ties (first index), NaN (the first NaN wins, as jnp.argmax), rows of -inf, one reduction for two inputs."""
  rng = np.random.default_rng(0)
  for trial in range(60):
    V = int(rng.integers(1, 40))
    z = rng.integers(-3, 3, size=(2, 5, V)).astype(np.float32)
    if trial % 3 == 0:
      z[0, 1, rng.integers(V)] = np.nan
      z[0, 1, rng.integers(V)] = np.nan
    if trial % 4 == 0:
      z[1, 2, :] = -np.inf
    y = -z
    m0, a0, m1, a1 = common.max_and_argmax(jnp.asarray(z), jnp.asarray(y))
    for x, m, a in ((z, m0, a0), (y, m1, a1)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(jnp.argmax(jnp.asarray(x), -1)))
      np.testing.assert_array_equal(np.asarray(m), np.asarray(jnp.max(jnp.asarray(x), -1)))


def test_greedy_proposal_is_the_gathered_softmax():
  """The one-pass greedy proposal equals argmax + softmax_at bit for bit (ties included)."""
  rng = np.random.default_rng(1)
  z = jnp.asarray(np.round(rng.normal(size=(3, 8, 50)) * 4, 1).astype(np.float32))
  p = common.propose(z, mask_id=7)
  alt = jnp.argmax(jnp.where(jnp.arange(50) == 7, -jnp.inf, z), -1)
  np.testing.assert_array_equal(np.asarray(p.token), np.asarray(jnp.argmax(z, -1)))
  np.testing.assert_array_equal(np.asarray(p.alt_token), np.asarray(alt))
  np.testing.assert_array_equal(np.asarray(p.conf), np.asarray(common.softmax_at(z, p.token)))
  np.testing.assert_array_equal(np.asarray(p.alt_conf), np.asarray(common.softmax_at(z, p.alt_token)))
