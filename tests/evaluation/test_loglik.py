"""LLaDA's Monte-Carlo log-likelihood against direct computations on the embedded tiny model: exact for a
one-token continuation, within its sampling error of the fully enumerated expectation for three tokens,
and each copy's term equal to an unpadded forward."""
import itertools

import numpy as np
import pytest

import dinfer_jax
from dinfer_jax.evaluation.loglik import copy_logps, mask_counts, mc_loglikelihood, noisy_copies

CONTEXT = [3, 17, 40, 22, 9, 31, 5]
TARGET = [12, 45, 7]


@pytest.fixture(scope="module")
def model():
  return dinfer_jax.load("default")


def _direct_logp(model, seq, masked, target_at):
  """sum_i log softmax(forward(seq))[i, target_at[i]] over masked i, from the plain unpadded forward."""
  logits = np.asarray(dinfer_jax.forward(model, [seq])[0], np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
      logits.max(-1, keepdims=True)
  return sum(logp[i, target_at[i]] for i in masked)


def test_mask_counts_are_stratified():
  """Over the L equally likely starts k0, every copy's count takes each value 1..L once: each k_j is
  uniform, which is what makes the estimate unbiased."""
  for L, b in ((4, 8), (3, 3), (5, 10), (1, 4), (7, 32)):
    ks = np.stack([mask_counts(L, b, k0) for k0 in range(1, L + 1)])  # [k0, j]
    assert ks.min() >= 1 and ks.max() <= L
    for j in range(b):
      assert sorted(ks[:, j]) == list(range(1, L + 1))
  assert mask_counts(4, 4, 2).tolist() == [2, 3, 4, 1]


def test_each_copy_term_equals_an_unpadded_forward(model):
  mask = model.config.mask_token_id
  rng = np.random.default_rng(1)
  noisy = noisy_copies(CONTEXT, TARGET, np.array([1, 2, 3]), mask, rng)
  got = copy_logps(model, CONTEXT, TARGET, noisy, mask)
  P = len(CONTEXT)
  for row, g in zip(noisy, got):
    masked = [i for i in range(P, P + len(TARGET)) if row[i] == mask]
    want = _direct_logp(model, row.tolist(), masked, {P + j: t for j, t in enumerate(TARGET)})
    assert g == pytest.approx(want, abs=1e-4)


def test_one_token_continuation_is_exact(model):
  """L = 1: every copy masks the one token with weight 1, so the estimate is log p(c | x, MASK) exactly."""
  mask = model.config.mask_token_id
  est, terms = mc_loglikelihood(model, CONTEXT, [12], mc_num=8, batch_size=4)
  want = _direct_logp(model, CONTEXT + [mask], [len(CONTEXT)], {len(CONTEXT): 12})
  assert est == pytest.approx(want, abs=1e-4) and np.ptp(terms) < 1e-5


def test_estimate_converges_to_the_enumerated_expectation(model):
  """L = 3: the expectation is enumerated over every (k, subset) from unpadded forwards; the estimate
  from 256 copies lies within 4 standard errors of it (and the estimator is unbiased, so it must)."""
  mask = model.config.mask_token_id
  P, L = len(CONTEXT), len(TARGET)
  exact = 0.0
  for k in range(1, L + 1):
    subsets = list(itertools.combinations(range(L), k))
    for s in subsets:
      seq = CONTEXT + [mask if j in s else t for j, t in enumerate(TARGET)]
      lp = _direct_logp(model, seq, [P + j for j in s], {P + j: t for j, t in enumerate(TARGET)})
      exact += (1 / L) * (1 / len(subsets)) * (L / k) * lp
  est, terms = mc_loglikelihood(model, CONTEXT, TARGET, mc_num=256, batch_size=32, seed=3)
  se = terms.std(ddof=1) / np.sqrt(len(terms))
  assert se > 0 and abs(est - exact) < 4 * se, (est, exact, se)
  # Same seed, same estimate.
  assert mc_loglikelihood(model, CONTEXT, TARGET, mc_num=256, batch_size=32, seed=3)[0] == est


def test_bad_arguments(model):
  with pytest.raises(ValueError, match="multiple"):
    mc_loglikelihood(model, CONTEXT, TARGET, mc_num=10, batch_size=4)
  with pytest.raises(ValueError, match="empty"):
    mc_loglikelihood(model, CONTEXT, [])
  with pytest.raises(ValueError, match="max_position"):
    mc_loglikelihood(model, [3] * (model.config.max_position + 1), TARGET)
