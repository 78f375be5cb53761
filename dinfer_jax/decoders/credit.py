"""dInfer's credit decoder (docs/design.md, D4): threshold decoding on logits boosted by decayed past argmax credit."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from dinfer_jax.decoders import common
from dinfer_jax.decoders.base import Decoder, Knobs, as_f32, check_positive_int, check_real, register


class CreditState(NamedTuple):
  """Per-block credit state.

  Attributes:
    credit: [B, L, V] fp32 accumulated credit C. Memory is B·L·V·4 bytes, about 40 MB per row for
      L=64 and V≈157k, which is why it lives only for one block.
    calls: int32 scalar, number of steps taken in this block (decay is skipped on the first).
  """

  credit: jax.Array
  calls: jax.Array


@flax.struct.dataclass
class CreditKnobs(Knobs):
  """credit_alpha: weight of log1p(credit) added to the logits (>= 0); credit_gamma: exponent on the top-1
  probability when accumulating (> 0); credit_beta: per-step decay of the credit, in [0, 1]."""
  credit_alpha: Any = 0.7
  credit_gamma: Any = 0.2
  credit_beta: Any = 0.8


@register("credit")
@dataclasses.dataclass(frozen=True)
class CreditDecoder(Decoder):
  """Threshold decoding (D2, with the stall guard) on z' = z + alpha·log1p(C).

  Every step: C ← beta·C (except the block's first step); p = softmax(fp32 z);
  C[l, argmax p_l] += mask_l · (max p_l)^gamma; then both x0 and its confidence come from z'. A token
  that stays top-1 over several steps thus gains confidence and can overtake the current top-1.
  Unlike dInfer, the state is reset at every block (init_state gives zeros) and never shared between
  requests (docs/design.md, "Decoders").

  Attributes:
    vocab_size: V; init_state sees only tokens, so the [B, L, V] state needs it here.
  """

  vocab_size: int
  Knobs = CreditKnobs

  def __post_init__(self):
    check_positive_int(self, "vocab_size")

  @classmethod
  def from_config(cls, gcfg: Any, *, vocab_size: int) -> "CreditDecoder":
    return cls(vocab_size=vocab_size)

  @classmethod
  def check_knobs(cls, values: Mapping[str, Any], owner: str) -> None:
    super().check_knobs(values, owner)
    check_real(values, "credit_alpha", owner, 0.0, None)
    check_real(values, "credit_gamma", owner, 0.0, None, lo_open=True)
    check_real(values, "credit_beta", owner, 0.0, 1.0)

  def init_state(self, tokens: jax.Array, maskable: jax.Array) -> CreditState:
    """Zero credit for a new block. tokens [B, L] int32, maskable [B, L] bool."""
    del maskable
    b, l = tokens.shape
    return CreditState(jnp.zeros((b, l, self.vocab_size), jnp.float32), jnp.zeros((), jnp.int32))

  def step(self, state: CreditState, logits: jax.Array, tokens: jax.Array, maskable: jax.Array,
           knobs: CreditKnobs, *, mask_id: int, temperature: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, CreditState]:
    """One credit step; arguments and results as in `Decoder.step`."""
    if logits.shape[-1] != self.vocab_size:
      raise ValueError(f"CreditDecoder.vocab_size: {self.vocab_size} does not match the logits' vocab "
                       f"dimension {logits.shape[-1]}")
    z = logits.astype(jnp.float32)
    masked = common.masked_positions(tokens, maskable, mask_id)
    # dInfer skips the decay on a block's first call; with zero-initialised credit that is a no-op
    # either way, but the counter keeps the rule explicit should the state ever start non-zero.
    credit = jnp.where(state.calls > 0, as_f32(knobs.credit_beta) * state.credit, state.credit)
    # The credit tracks the plain (un-noised) top-1, as in dInfer; sampling only affects x0 below.
    # argmax z equals dInfer's argmax p except where distinct logits round to the same probability.
    top = jnp.argmax(z, axis=-1).astype(jnp.int32)
    gain = jnp.where(masked, common.softmax_at(z, top) ** as_f32(knobs.credit_gamma), 0.0)
    vocab = jnp.arange(z.shape[-1], dtype=jnp.int32)
    credit = credit + jnp.where(vocab == top[..., None], gain[..., None], 0.0)
    fused = z + as_f32(knobs.credit_alpha) * jnp.log1p(credit)
    new_tokens, committed = common.threshold_decode(fused, tokens, maskable, mask_id=mask_id,
                                                    threshold=knobs.threshold, temperature=temperature, rng=rng)
    return new_tokens, committed, CreditState(credit, state.calls + 1)
