"""dInfer's hierarchical decoder (§3a) for any batch size: at most the best token of each masked run."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dinfer_jax.decoders import common


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


@dataclasses.dataclass(frozen=True)
class HierarchyDecoder(common.Stateless):
  """Commits {run maxima with c > low} ∪ {c > threshold} ∪ {row's global argmax}, among masked positions.

  Runs are maximal spans of masked positions inside the block; committing inside a run splits it, so
  the number of runs roughly doubles per step. Run maxima use exact equality, so every tied maximum
  commits. Both thresholds are strict. The global argmax (first index on ties) makes every row with
  masks commit at least once. Confidence is fp32 for every model family (Decisions §3).

  dInfer does not exclude x0 == MASK here and would write MASK, leaving the position masked (a
  possible stall). We keep its selection (confidence of x0, MASK or not) but write the best non-MASK
  token at such a committed position, so every commit really decodes a token. Stateless.

  Attributes:
    threshold: default high threshold in [0, 1]; the engine passes the step's threshold to `step`.
    low_threshold: run-maximum threshold in [0, threshold] (dInfer's class default 0.4).
  """

  threshold: float
  low_threshold: float = 0.4

  def __post_init__(self):
    common.check_real(self, "threshold", 0.0, 1.0)
    common.check_real(self, "low_threshold", 0.0, self.threshold)

  def step(self, state: tuple[()], logits: jax.Array, tokens: jax.Array, maskable: jax.Array, *,
           mask_id: int, threshold: jax.Array | None = None, temperature: float = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, tuple[()]]:
    """One hierarchical step.

    Arguments and results as in `common.Decoder.step`.
    """
    high = common.resolve_threshold(threshold, self.threshold)
    prop = common.propose(logits, mask_id=mask_id, temperature=temperature, rng=rng)
    masked = common.masked_positions(tokens, maskable, mask_id)
    c = jnp.where(masked, prop.conf, -jnp.inf)
    at_run_max = masked & (c == run_max(c, masked))
    commit = ((at_run_max & (c > jnp.float32(self.low_threshold)))
              | (masked & (c > high))
              | common.first_argmax(c, masked))
    return common.write_tokens(tokens, commit, prop, mask_id), commit, state
