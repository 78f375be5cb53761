"""dInfer's hierarchical decoder (docs/design.md, D3) for any batch size: at most the best token of each masked run."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp

from dinfer_jax.decoders import common
from dinfer_jax.decoders.base import Decoder, Knobs, as_f32, check_real, register


def run_ids(masked: jax.Array) -> jax.Array:
  """[B, L] int32 id of the maximal run of consecutive masked positions each position belongs to.

  A run starts at a masked j when j == 0 or j-1 is not masked, so runs are bounded by the block and
  by decoded (or non-maskable) positions. Ids count starts per row from 0; values at non-masked
  positions are meaningless and must be ignored via `masked`.

  Args:
    masked: [B, L] bool.
  """
  prev = jnp.pad(masked[:, :-1], ((0, 0), (1, 0)), constant_values=False)
  starts = masked & ~prev
  return jnp.cumsum(starts, axis=-1, dtype=jnp.int32) - 1


def run_max(conf: jax.Array, masked: jax.Array) -> jax.Array:
  """[B, L] fp32: at each masked position, the max confidence over its run (-inf elsewhere).

  Args:
    conf: [B, L] fp32.
    masked: [B, L] bool.
  """
  runs = run_ids(masked)
  # [B, L, L] membership: L is a block length (tens to hundreds), so this is cheap and needs no scatter.
  same = (runs[:, :, None] == runs[:, None, :]) & masked[:, None, :] & masked[:, :, None]
  return jnp.max(jnp.where(same, conf[:, None, :], -jnp.inf), axis=-1)


@flax.struct.dataclass
class HierarchyKnobs(Knobs):
  """threshold: the high threshold; low_threshold: the run-maximum threshold, in [0, threshold]."""
  low_threshold: Any = 0.6


@register("hierarchy")
@dataclasses.dataclass(frozen=True)
class HierarchyDecoder(Decoder):
  """Commits {run maxima with c > low} ∪ {c > threshold} ∪ {row's global argmax}, among masked positions.

  Runs are maximal spans of masked positions inside the block; committing inside a run splits it, so
  the number of runs roughly doubles per step. Run maxima use exact equality, so every tied maximum
  commits. Both thresholds are strict. The global argmax (first index on ties) makes every row with
  masks commit at least once. Confidence is fp32 for every model family (docs/design.md, "Decoders").

  dInfer does not exclude x0 == MASK here and would write MASK, leaving the position masked (a
  possible stall). We keep its selection (confidence of x0, MASK or not) but write the best non-MASK
  token at such a committed position, so every commit really decodes a token. Stateless.
  """

  Knobs = HierarchyKnobs

  @classmethod
  def check_knobs(cls, values: Mapping[str, Any], owner: str) -> None:
    super().check_knobs(values, owner)
    check_real(values, "low_threshold", owner, 0.0, 1.0)
    if not isinstance(values["low_threshold"], jax.core.Tracer) and not isinstance(values["threshold"], jax.core.Tracer) \
        and float(values["low_threshold"]) > float(values["threshold"]):
      raise ValueError(f"{owner}.low_threshold={values['low_threshold']!r}: must not exceed "
                       f"threshold={values['threshold']}")

  def step(self, state: tuple[()], logits: jax.Array, tokens: jax.Array, maskable: jax.Array,
           knobs: HierarchyKnobs, *, mask_id: int, temperature: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, tuple[()]]:
    """One hierarchical step; arguments and results as in `Decoder.step`."""
    high = as_f32(knobs.threshold)
    prop = common.propose(logits, mask_id=mask_id, temperature=temperature, rng=rng)
    masked = common.masked_positions(tokens, maskable, mask_id)
    c = jnp.where(masked, prop.conf, -jnp.inf)
    at_run_max = masked & (c == run_max(c, masked))
    commit = ((at_run_max & (c > as_f32(knobs.low_threshold)))
              | (masked & (c > high))
              | common.first_argmax(c, masked))
    return common.write_tokens(tokens, commit, prop, mask_id), commit, state
