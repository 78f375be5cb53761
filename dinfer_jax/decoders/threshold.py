"""dInfer's threshold parallel decoder (§2a) with a guard against rows that would commit nothing."""
from __future__ import annotations

import dataclasses

import jax

from dinfer_jax.decoders import common


@dataclasses.dataclass(frozen=True)
class ThresholdDecoder(common.Stateless):
  """Commits every masked position whose fp32 confidence reaches the row's threshold τ_row.

  τ_row = clamp(max_c - 1e-5, -1000, threshold), so the row's best candidate (and anything within 1e-5
  of it) always commits. Positions whose argmax is the MASK id are never candidates. If that leaves a
  row with masks but nothing to commit, the stall guard commits its most confident masked position
  with the best non-MASK token (Decisions §2). Stateless.

  Attributes:
    threshold: default confidence threshold in [0, 1]; the engine normally passes it (or the
      iteration-smoothing threshold) to `step`.
  """

  threshold: float

  def __post_init__(self):
    common.check_real(self, "threshold", 0.0, 1.0)

  def step(self, state: tuple[()], logits: jax.Array, tokens: jax.Array, maskable: jax.Array, *,
           mask_id: int, threshold: jax.Array | None = None, temperature: float = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, tuple[()]]:
    """One threshold step.

    Arguments and results as in `common.Decoder.step`.
    """
    new_tokens, committed = common.threshold_decode(
        logits, tokens, maskable, mask_id=mask_id,
        threshold=common.resolve_threshold(threshold, self.threshold), temperature=temperature, rng=rng)
    return new_tokens, committed, state
