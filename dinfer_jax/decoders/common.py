"""Shared decoder pieces: token proposal, the threshold rule and the stall guard."""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

# dInfer's tie tolerance: a row commits everything within this distance of its best confidence (docs/design.md, D2).
TIE_TOLERANCE = 1e-5
# dInfer's lower clamp on the per-row threshold; with no candidate (max = -inf) nothing reaches it.
TAU_FLOOR = -1000.0


class Proposal(NamedTuple):
  """Per-position token proposals of one step; all [B, L].

  Attributes:
    token: int32 x0, the argmax of the (noised, if temperature > 0) logits.
    conf: fp32 plain softmax probability of `token` (never tempered, never noised).
    alt_token: int32 best token with the MASK id excluded, picked from the same noised scores.
    alt_conf: fp32 plain softmax probability of `alt_token`.
  """

  token: jax.Array
  conf: jax.Array
  alt_token: jax.Array
  alt_conf: jax.Array


def masked_positions(tokens: jax.Array, maskable: jax.Array, mask_id: int) -> jax.Array:
  """[B, L] bool: positions still to decode (MASK and inside the block)."""
  return (tokens == mask_id) & maskable


def _gumbel(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """fp32 Gumbel(0, 1) noise of `shape` [B, L, V] from one key or from one key per row."""
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  key_batch_dims = rng.ndim if typed else rng.ndim - 1
  if key_batch_dims == 0:
    return jax.random.gumbel(rng, shape, jnp.float32)
  if key_batch_dims == 1 and rng.shape[0] == shape[0]:
    # One key per row keeps a row's sample independent of what else is in the batch.
    return jax.vmap(lambda k: jax.random.gumbel(k, shape[1:], jnp.float32))(rng)
  raise ValueError(f"rng: expected one PRNG key or one key per row ({shape[0]}), got shape {rng.shape}")


def check_sampling(temperature: float | jax.Array, rng: jax.Array | None) -> None:
  """Trace-time validation of the sampling arguments. A jax scalar temperature is a traced runtime value
  (the engine's, validated on the host): it always samples."""
  if isinstance(temperature, jax.Array):
    if temperature.ndim != 0:
      raise ValueError(f"temperature: must be a scalar (got shape {temperature.shape})")
    if rng is None:
      raise ValueError("rng: a PRNG key is required with a traced temperature")
    return
  if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
      math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"temperature: must be a static, finite Python float >= 0 (got {temperature!r})")
  if temperature > 0 and rng is None:
    raise ValueError("rng: a PRNG key is required when temperature > 0")


def softmax_at(z: jax.Array, token: jax.Array) -> jax.Array:
  """[B, L] fp32 softmax(z)[token] of fp32 logits z [B, L, V] and int token [B, L].

  Computed as exp(z_t - max) / sum(exp(z - max)) and gathered, so no [B, L, V] softmax is kept.
  """
  zmax = jnp.max(z, axis=-1, keepdims=True)
  denom = jnp.sum(jnp.exp(z - zmax), axis=-1)
  z_t = jnp.take_along_axis(z, token[..., None], axis=-1)[..., 0]
  return jnp.exp(z_t - zmax[..., 0]) / denom


def propose(logits: jax.Array, *, mask_id: int, temperature: float = 0.0,
            rng: jax.Array | None = None) -> Proposal:
  """Picks x0 (and the best non-MASK token) per position and their plain fp32 confidences.

  temperature 0 is a pure argmax (first index on ties, no noise). temperature > 0 takes the argmax of
  logits + temperature * Gumbel(rng), i.e. a sample from softmax(logits / temperature); the noise only
  chooses the token, the confidence stays the un-tempered softmax (docs/design.md, D12).

  Args:
    logits: [B, L, V] logits of the block (cast to fp32).
    mask_id: static MASK token id.
    temperature: static float >= 0, or a traced fp32 scalar (> 0: the program samples, one program for
      every temperature).
    rng: PRNG key, or [B] keys (one per row); only read when sampling.

  Returns:
    A Proposal of [B, L] arrays.
  """
  check_sampling(temperature, rng)
  z = logits.astype(jnp.float32)
  sampling = isinstance(temperature, jax.Array) or temperature > 0
  scores = z + temperature * _gumbel(rng, z.shape) if sampling else z
  vocab = jnp.arange(z.shape[-1], dtype=jnp.int32)
  # A where over the vocab iota (not .at[mask_id]) stays valid even if mask_id is outside the vocab.
  alt_scores = jnp.where(vocab == mask_id, -jnp.inf, scores)
  if sampling:
    token = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    alt_token = jnp.argmax(alt_scores, axis=-1).astype(jnp.int32)
    return Proposal(token, softmax_at(z, token), alt_token, softmax_at(z, alt_token))
  # Greedy: both argmaxes and their values from one pass over the logits, then one for the softmax's sum,
  # instead of five (two argmaxes, the max, the sum, the gathers of z at the tokens): each pass reads the
  # block's [B, L, V] fp32 logits, 0.3 GB of a batch-8 cached step. The same numbers: z at the argmax is the
  # max, so exp(z_token - max) is exp(0) = 1 exactly as before.
  zmax, token, alt_max, alt_token = max_and_argmax(z, alt_scores)
  denom = jnp.sum(jnp.exp(z - zmax[..., None]), axis=-1)
  return Proposal(token, jnp.exp(zmax - zmax) / denom, alt_token, jnp.exp(alt_max - zmax) / denom)


def max_and_argmax(*xs: jax.Array) -> tuple[jax.Array, ...]:
  """(max, argmax) over the last axis of each of `xs` (same shape), in one reduction: jnp.argmax's order
  (the first index on ties, NaN wins) with its value kept. Returns max_0, argmax_0 (int32), max_1, ..."""
  idx = jax.lax.broadcasted_iota(jnp.int32, xs[0].shape, xs[0].ndim - 1)

  def pick(a, b):
    out = []
    for k in range(0, len(a), 2):
      (av, ai), (bv, bi) = a[k:k + 2], b[k:k + 2]
      take_b = (bv > av) | ((bv != bv) & (av == av)) | ((bv == av) & (bi < ai)) | ((bv != bv) & (av != av) & (bi < ai))
      out += [jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)]
    return tuple(out)
  operands = tuple(o for x in xs for o in (x, idx))
  inits = tuple(o for x in xs for o in (jnp.array(-jnp.inf, x.dtype), jnp.array(0, jnp.int32)))
  return jax.lax.reduce(operands, inits, pick, (xs[0].ndim - 1,))


def first_argmax(values: jax.Array, valid: jax.Array) -> jax.Array:
  """[B, L] bool one-hot of each row's largest valid value (first index on ties); all False if no valid.

  Args:
    values: [B, L] fp32.
    valid: [B, L] bool.
  """
  best = jnp.argmax(jnp.where(valid, values, -jnp.inf), axis=-1)
  onehot = jnp.arange(values.shape[-1])[None, :] == best[:, None]
  return onehot & jnp.any(valid, axis=-1, keepdims=True)


def threshold_rule(conf: jax.Array, candidate: jax.Array, threshold: jax.Array) -> jax.Array:
  """dInfer's threshold selection (docs/design.md, D2) on [B, L]: commit c >= clamp(max c - 1e-5, -1000, threshold).

  So a row commits every candidate >= threshold when its best clears threshold + 1e-5, and otherwise
  its best together with every candidate within 1e-5 of it.

  Args:
    conf: [B, L] fp32 confidences.
    candidate: [B, L] bool positions allowed to commit.
    threshold: fp32 scalar.

  Returns:
    [B, L] bool commit mask (a subset of candidate; empty for rows without candidates).
  """
  c = jnp.where(candidate, conf, -jnp.inf)
  best = jnp.max(c, axis=-1, keepdims=True)
  tau = jnp.clip(best - jnp.float32(TIE_TOLERANCE), jnp.float32(TAU_FLOOR),
                 jnp.asarray(threshold, jnp.float32))
  return candidate & (c >= tau)


def stall_guard(commit: jax.Array, masked: jax.Array, alt_conf: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Forces one commit in rows that still have masks but would commit nothing (docs/design.md, D2).

  dInfer would loop forever there (e.g. every masked argmax is MASK). The forced position is the
  row's masked position whose best non-MASK token is most probable (first index on ties).

  Args:
    commit: [B, L] bool selection so far.
    masked: [B, L] bool positions still masked.
    alt_conf: [B, L] fp32 confidence of the best non-MASK token.

  Returns:
    (commit | forced, forced), both [B, L] bool; forced positions must take the alt token.
  """
  stalled = jnp.any(masked, axis=-1, keepdims=True) & ~jnp.any(commit, axis=-1, keepdims=True)
  forced = first_argmax(alt_conf, masked) & stalled
  return commit | forced, forced


def write_tokens(tokens: jax.Array, commit: jax.Array, prop: Proposal, mask_id: int,
                 forced: jax.Array | None = None) -> jax.Array:
  """[B, L] int32 canvas with committed positions set; a committed token is never the MASK id.

  Where x0 is MASK (or the position was forced by the stall guard) the best non-MASK token is
  written instead, since writing MASK would leave the position masked and could stall the block.
  """
  use_alt = prop.token == mask_id
  if forced is not None:
    use_alt = use_alt | forced
  chosen = jnp.where(use_alt, prop.alt_token, prop.token)
  return jnp.where(commit, chosen, tokens).astype(jnp.int32)


def threshold_decode(logits: jax.Array, tokens: jax.Array, maskable: jax.Array, *, mask_id: int,
                     threshold: jax.Array, temperature: float,
                     rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """dInfer's threshold decoder step (docs/design.md, D2) plus the stall guard, on already-fused logits.

  Args:
    logits: [B, L, V] logits (cast to fp32).
    tokens: [B, L] int32 block canvas.
    maskable: [B, L] bool block membership.
    mask_id: static MASK id.
    threshold: fp32 scalar.
    temperature: static float.
    rng: PRNG key (used when temperature > 0).

  Returns:
    (new_tokens [B, L] int32, committed [B, L] bool).
  """
  prop = propose(logits, mask_id=mask_id, temperature=temperature, rng=rng)
  masked = masked_positions(tokens, maskable, mask_id)
  # dInfer's rm_mask: a position whose argmax is MASK is never a candidate.
  candidate = masked & (prop.token != mask_id)
  commit = threshold_rule(prop.conf, candidate, threshold)
  commit, forced = stall_guard(commit, masked, prop.alt_conf)
  return write_tokens(tokens, commit, prop, mask_id, forced), commit
