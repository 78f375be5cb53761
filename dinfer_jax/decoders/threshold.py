"""dInfer's threshold parallel decoder (docs/design.md, D2) with a guard against rows that would commit nothing."""
from __future__ import annotations

import dataclasses

import jax

from dinfer_jax.decoders import common
from dinfer_jax.decoders.base import Decoder, Knobs, register


@register("threshold")
@dataclasses.dataclass(frozen=True)
class ThresholdDecoder(Decoder):
  """Commits every masked position whose fp32 confidence reaches the row's threshold τ_row.

  τ_row = clamp(max_c - 1e-5, -1000, threshold), so the row's best candidate (and anything within 1e-5
  of it) always commits. Positions whose argmax is the MASK id are never candidates. If that leaves a
  row with masks but nothing to commit, the stall guard commits its most confident masked position
  with the best non-MASK token (docs/design.md, "Decoders"). Stateless; knobs: threshold.
  """

  def step(self, state: tuple[()], logits: jax.Array, tokens: jax.Array, maskable: jax.Array, knobs: Knobs, *,
           mask_id: int, temperature: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, tuple[()]]:
    """One threshold step; arguments and results as in `Decoder.step`."""
    new_tokens, committed = common.threshold_decode(logits, tokens, maskable, mask_id=mask_id,
                                                    threshold=knobs.threshold, temperature=temperature, rng=rng)
    return new_tokens, committed, state
