"""log p(continuation | context) for a masked diffusion LM: LLaDA's Monte-Carlo estimate of its ELBO.

A diffusion LM has no left-to-right factorisation; LLaDA (Nie et al. 2025, its lm-eval evaluator) scores
a continuation c (L tokens) after a context x by the bound

    log p(c | x) >= E_{k ~ U{1..L}, S ~ U(k-subsets of c)} [ (L / k) * sum_{i in S} log p(c_i | x, c with S masked) ]

estimated from mc_num noisy copies. As LLaDA does, the copies are drawn in batches of b whose mask counts
are stratified over 1..L (k_j = (k0 + round(j L / b) - 1) mod L + 1 for a uniform k0; see mask_counts), and the positions
masked in each copy are a uniform random k-subset. Every copy is one full bidirectional forward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.model.transformer import forward as _forward
from dinfer_jax.sharding import use_mesh

LENGTH_BUCKET = 32  # sequences are right-padded to a multiple of this (padding masked out of attention)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _masked_target_logp(params, tokens, valid, targets, scored, cfg):
  """Per row: sum over scored positions of log p(targets | tokens). tokens/targets/valid/scored [b, T]."""
  logits = _forward(params, cfg, tokens, mask=valid).logits  # [b, T, V] fp32
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.where(scored, picked, 0.0).sum(axis=-1)


def mask_counts(L: int, b: int, k0: int) -> np.ndarray:
  """LLaDA's stratified mask counts for a batch of b copies, spread evenly from k0 (drawn uniformly from
  1..L). The offsets j L / b are rounded on their own, so each k_j is exactly uniform on 1..L; LLaDA rounds
  k0 + j L / b half to even, which favours even counts when j L / b ends in .5 (a small bias)."""
  x = k0 + np.round(np.arange(b) * (L / b)).astype(int)
  return (x - 1) % L + 1


def noisy_copies(context, target, counts, mask_id: int, rng: np.random.Generator) -> np.ndarray:
  """[len(counts), P + L] copies of context + target with counts[j] random target positions masked."""
  P, L = len(context), len(target)
  seq = np.array(list(context) + list(target), np.int32)
  out = np.tile(seq, (len(counts), 1))
  for j, k in enumerate(counts):
    out[j, P + rng.permutation(L)[:k]] = mask_id
  return out


def copy_logps(model, context, target, noisy: np.ndarray, mask_id: int) -> np.ndarray:
  """For each noisy copy: sum over its masked target positions of log p(target_i | copy), fp32 [n]."""
  P, L = len(context), len(target)
  n, T = noisy.shape
  Tp = -(-T // LENGTH_BUCKET) * LENGTH_BUCKET
  tokens = np.full((n, Tp), mask_id, np.int32)
  tokens[:, :T] = noisy
  valid = np.zeros((n, Tp), bool)
  valid[:, :T] = True
  targets = np.zeros((n, Tp), np.int32)
  targets[:, P:T] = np.asarray(target, np.int32)
  scored = tokens == mask_id
  scored[:, :P] = False
  scored[:, T:] = False
  with use_mesh(getattr(model, "mesh", None)):
    out = _masked_target_logp(model.params, jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(targets),
                              jnp.asarray(scored), model.config)
  return np.asarray(out, np.float64)


def mc_loglikelihood(model, context, target, *, mc_num: int = 128, batch_size: int = 32, seed: int = 0,
                     mask_id: int | None = None) -> tuple[float, np.ndarray]:
  """LLaDA's Monte-Carlo estimate of log p(target | context) (see the module docstring).

  Args:
    model: a dinfer_jax Model.
    context, target: token ids (target non-empty).
    mc_num: noisy copies in all (a multiple of batch_size, as in LLaDA).
    batch_size: copies per forward (the stratification unit).
  Returns: (estimate, the per-copy terms (L / k) * sum log p whose mean is the estimate).
  """
  L = len(target)
  if L == 0:
    raise ValueError("mc_loglikelihood: the continuation is empty")
  if mc_num <= 0 or batch_size <= 0 or mc_num % batch_size:
    raise ValueError(f"mc_loglikelihood: mc_num={mc_num} must be a positive multiple of batch_size={batch_size}")
  if len(context) + L > model.config.max_position:
    raise ValueError(f"mc_loglikelihood: {len(context)} context + {L} continuation tokens exceed the model's "
                     f"max_position={model.config.max_position}")
  mask_id = int(model.config.mask_token_id if mask_id is None else mask_id)
  rng = np.random.default_rng(seed)
  terms = []
  for _ in range(mc_num // batch_size):
    counts = mask_counts(L, batch_size, int(rng.integers(1, L + 1)))
    noisy = noisy_copies(context, target, counts, mask_id, rng)
    terms.append(copy_logps(model, context, target, noisy, mask_id) * L / counts)
  terms = np.concatenate(terms)
  return float(terms.mean()), terms
