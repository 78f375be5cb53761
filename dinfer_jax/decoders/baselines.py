"""Baseline decoders for like-for-like benchmarks: LLaDA's fixed-step schedule and Fast-dLLM's rule."""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dinfer_jax.decoders import common
from dinfer_jax.decoders.base import Decoder, Knobs, as_f32, check_positive_int, register


class FixedStepsState(NamedTuple):
  """Per-block schedule state.

  Attributes:
    num_masked: [B] int32 masks m of the block, counted at its first step.
    step: int32 scalar index i of the next step within the block.
  """

  num_masked: jax.Array
  step: jax.Array


def num_transfer_tokens(num_masked: jax.Array, step: jax.Array, steps: int) -> jax.Array:
  """[B] int32 tokens to commit at step i: floor(m/S) + [i < m mod S], and 0 once i >= S.

  The remainder goes to the earliest steps, as in LLaDA's get_num_transfer_tokens, so the schedule
  sums to m over S steps.

  Args:
    num_masked: [B] int32 m.
    step: int32 scalar i.
    steps: static S.
  """
  n = num_masked // steps + (step < num_masked % steps).astype(jnp.int32)
  return jnp.where(step < steps, n, 0).astype(jnp.int32)


@register("fixed_steps")
@dataclasses.dataclass(frozen=True)
class FixedStepsDecoder(Decoder):
  """LLaDA's low-confidence schedule (docs/design.md, D5): step i commits the n_i most confident masked positions.

  n_i = floor(m/S) + [i < m mod S] with m the block's masks per row at its first step. Ties in confidence
  go to the lower index (lax.top_k order). As in LLaDA, x0 == MASK is not excluded from the ranking,
  but a committed position gets the best non-MASK token so the schedule really decodes n_i tokens.

  The engine runs a block until no masks remain: with m counted at block entry the schedule empties
  the block in at most S steps (fewer when m < S, skipping LLaDA's zero-token steps). If steps are
  called past S while masks remain (impossible when m was counted correctly), they commit nothing.
  Its threshold knob is unused.

  Attributes:
    steps_per_block: S, steps per block (LLaDA's steps / number of blocks; GenerationConfig.steps_per_block).
  """

  steps_per_block: int
  static_fields = ("steps_per_block",)

  def __post_init__(self):
    check_positive_int(self, "steps_per_block")

  @classmethod
  def from_config(cls, gcfg: Any, *, vocab_size: int) -> "FixedStepsDecoder":
    return cls(steps_per_block=gcfg.steps_per_block)

  @classmethod
  def check_config(cls, gcfg: Any) -> None:
    super().check_config(gcfg)

    def bad(field, msg):
      raise ValueError(f"GenerationConfig.{field}={getattr(gcfg, field)!r}: {msg}")
    if gcfg.steps_per_block <= 0:
      bad("steps_per_block", "fixed_steps needs steps_per_block > 0")
    if gcfg.steps_per_block > gcfg.block_length:
      bad("steps_per_block", f"must not exceed block_length={gcfg.block_length}")
    if gcfg.gen_length % gcfg.block_length:
      bad("block_length", f"fixed_steps needs block_length to divide gen_length={gcfg.gen_length} "
                          "(LLaDA's schedule assumes equal blocks)")

  def init_state(self, tokens: jax.Array, maskable: jax.Array) -> FixedStepsState:
    """Fresh schedule. tokens [B, L] int32, maskable [B, L] bool.

    init_state does not get the MASK id, and maskable positions need not be masks (an aligned first
    block overlaps the prompt; EOS-filled rows have none), so m is counted at the block's first step
    instead, from the same, still untouched block.
    """
    del maskable
    return FixedStepsState(jnp.zeros(tokens.shape[:1], jnp.int32), jnp.zeros((), jnp.int32))

  def step(self, state: FixedStepsState, logits: jax.Array, tokens: jax.Array, maskable: jax.Array,
           knobs: Knobs, *, mask_id: int, temperature: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, FixedStepsState]:
    """One scheduled step; arguments and results as in `Decoder.step` (the threshold is unused)."""
    del knobs
    prop = common.propose(logits, mask_id=mask_id, temperature=temperature, rng=rng)
    masked = common.masked_positions(tokens, maskable, mask_id)
    num_masked = jnp.where(state.step == 0, jnp.sum(masked, axis=-1, dtype=jnp.int32), state.num_masked)
    n = num_transfer_tokens(num_masked, state.step, self.steps_per_block)
    b, l = tokens.shape
    _, order = jax.lax.top_k(jnp.where(masked, prop.conf, -jnp.inf), l)
    # rank[b, order[b, r]] = r: position's place in the descending confidence order.
    rank = jnp.zeros((b, l), jnp.int32).at[jnp.arange(b)[:, None], order].set(
        jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l)))
    commit = masked & (rank < n[:, None])
    new_tokens = common.write_tokens(tokens, commit, prop, mask_id)
    return new_tokens, commit, FixedStepsState(num_masked, state.step + 1)


@register("fastdllm")
@dataclasses.dataclass(frozen=True)
class FastDLLMDecoder(Decoder):
  """Fast-dLLM's threshold rule (docs/design.md, D5): the top-1 masked position plus every masked c >= threshold.

  The top-1 is the most confident masked position, lower index on ties. Unlike dInfer's rule there is
  no 1e-5 tolerance and x0 == MASK is not excluded, but a committed position gets the best non-MASK
  token so it really decodes. Stateless; knobs: threshold.
  """

  def step(self, state: tuple[()], logits: jax.Array, tokens: jax.Array, maskable: jax.Array, knobs: Knobs, *,
           mask_id: int, temperature: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, tuple[()]]:
    """One Fast-dLLM step; arguments and results as in `Decoder.step`."""
    thr = as_f32(knobs.threshold)
    prop = common.propose(logits, mask_id=mask_id, temperature=temperature, rng=rng)
    masked = common.masked_positions(tokens, maskable, mask_id)
    commit = (masked & (prop.conf >= thr)) | common.first_argmax(prop.conf, masked)
    return common.write_tokens(tokens, commit, prop, mask_id), commit, state
