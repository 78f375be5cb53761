"""dInfer's credit decoder (§4): threshold decoding on logits boosted by decayed past argmax credit."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dinfer_jax.decoders import common


class CreditState(NamedTuple):
  """Per-block credit state.

  Attributes:
    credit: [B, L, V] fp32 accumulated credit C. Memory is B·L·V·4 bytes, about 40 MB per row for
      L=64 and V≈157k, which is why it lives only for one block.
    calls: int32 scalar, number of steps taken in this block (decay is skipped on the first).
  """

  credit: jax.Array
  calls: jax.Array


@dataclasses.dataclass(frozen=True)
class CreditDecoder:
  """Threshold decoding (§2a + stall guard) on z' = z + alpha·log1p(C).

  Every step: C ← beta·C (except the block's first step); p = softmax(fp32 z);
  C[l, argmax p_l] += mask_l · (max p_l)^gamma; then both x0 and its confidence come from z'. A token
  that stays top-1 over several steps thus gains confidence and can overtake the current top-1.
  Unlike dInfer, the state is reset at every block (init_state gives zeros) and never shared between
  requests (Decisions §4).

  Attributes:
    threshold: default confidence threshold in [0, 1].
    alpha: weight of log1p(credit) added to the logits, >= 0.
    gamma: exponent on the top-1 probability when accumulating, >= 0.
    beta: per-step decay of the credit, in [0, 1].
    vocab_size: V, keyword-only; init_state sees only tokens, so the [B, L, V] state needs it here.
  """

  threshold: float
  alpha: float = 0.7
  gamma: float = 0.2
  beta: float = 0.8
  vocab_size: int = dataclasses.field(kw_only=True)

  def __post_init__(self):
    common.check_real(self, "threshold", 0.0, 1.0)
    common.check_real(self, "alpha", 0.0, None)
    common.check_real(self, "gamma", 0.0, None)
    common.check_real(self, "beta", 0.0, 1.0)
    common.check_positive_int(self, "vocab_size")

  def init_state(self, tokens: jax.Array, maskable: jax.Array) -> CreditState:
    """Zero credit for a new block. tokens [B, L] int32, maskable [B, L] bool."""
    del maskable
    b, l = tokens.shape
    return CreditState(jnp.zeros((b, l, self.vocab_size), jnp.float32), jnp.zeros((), jnp.int32))

  def step(self, state: CreditState, logits: jax.Array, tokens: jax.Array, maskable: jax.Array, *,
           mask_id: int, threshold: jax.Array | None = None, temperature: float = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, CreditState]:
    """One credit step.

    Arguments and results as in `common.Decoder.step`.
    """
    if logits.shape[-1] != self.vocab_size:
      raise ValueError(f"CreditDecoder.vocab_size: {self.vocab_size} does not match the logits' vocab "
                       f"dimension {logits.shape[-1]}")
    z = logits.astype(jnp.float32)
    masked = common.masked_positions(tokens, maskable, mask_id)
    # dInfer skips the decay on a block's first call; with zero-initialised credit that is a no-op
    # either way, but the counter keeps the rule explicit should the state ever start non-zero.
    credit = jnp.where(state.calls > 0, jnp.float32(self.beta) * state.credit, state.credit)
    # The credit tracks the plain (un-noised) top-1, as in dInfer; sampling only affects x0 below.
    # argmax z equals dInfer's argmax p except where distinct logits round to the same probability.
    top = jnp.argmax(z, axis=-1).astype(jnp.int32)
    gain = jnp.where(masked, common.softmax_at(z, top) ** jnp.float32(self.gamma), 0.0)
    vocab = jnp.arange(z.shape[-1], dtype=jnp.int32)
    credit = credit + jnp.where(vocab == top[..., None], gain[..., None], 0.0)
    fused = z + jnp.float32(self.alpha) * jnp.log1p(credit)
    new_tokens, committed = common.threshold_decode(
        fused, tokens, maskable, mask_id=mask_id,
        threshold=common.resolve_threshold(threshold, self.threshold), temperature=temperature, rng=rng)
    return new_tokens, committed, CreditState(credit, state.calls + 1)
