"""LLaDA2.1's JointThreshold decoder: mask-to-token (M2T) plus token-to-token editing (T2T) in the current block.

Per step and row (docs/design.md, D13; SGLang 0.5.23's semantics): with the mask token's logit at -inf
(excluded from the argmax and from the softmax), cand = argmax and p its fp32 probability.
- M2T: the block's masked positions with p > threshold; when none passes, the single most confident masked
  position (lowest index on ties).
- A step that starts with no mask counts toward the post-fill budget; once the count exceeds max_post_steps
  the block ends there (a budget exit) and nothing of that step is written.
- T2T: the block's generated positions (never the prompt: the positions that were not masks when the block
  started) that are not masked, whose cand differs from their token and has p > edit_threshold.
- If nothing is written the block is stable and ends. A block ends on a step that wrote nothing, so its last
  forward saw its final tokens: that forward's K/V are already clean (no extra forward for them).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from dinfer_jax.decoders import common
from dinfer_jax.decoders.base import Decoder, Knobs, as_f32, check_real, register


class JointThresholdState(NamedTuple):
  """Per-block state, [B] or [B, L] per field.

  editable: the block's generated positions (masks at the block's first step; the prompt tail is not).
  post: steps that started with no mask left (the post-fill budget's count).
  finished: the block has settled (a stable or a budget exit).
  calls: steps taken in this block (a scalar).
  """

  editable: jax.Array
  post: jax.Array
  finished: jax.Array
  calls: jax.Array


@flax.struct.dataclass
class JointThresholdKnobs(Knobs):
  """threshold: M2T's (strict >); edit_threshold: T2T's (strict >; p <= 1, so >= 1 turns editing off and 0
  edits wherever the argmax differs from the token)."""
  edit_threshold: Any = 0.0


@register("joint_threshold")
@dataclasses.dataclass(frozen=True)
class JointThresholdDecoder(Decoder):
  """M2T + T2T with a post-fill edit budget (module docstring).

  Attributes:
    max_post_steps: steps that start with no mask a block may take before its budget exit (>= 0).
  """

  max_post_steps: int = 16
  Knobs = JointThresholdKnobs
  static_fields = ("max_post_steps",)
  settles: ClassVar[bool] = True
  edits: ClassVar[bool] = True
  # LLaDA2.1's model-card presets: S(peed) lowers the fill threshold and leans on edits, Q(uality) does not.
  PRESETS: ClassVar[dict[str, dict[str, float]]] = {"S": {"threshold": 0.5, "edit_threshold": 0.0},
                                                    "Q": {"threshold": 0.7, "edit_threshold": 0.5}}

  def __post_init__(self):
    if isinstance(self.max_post_steps, bool) or not isinstance(self.max_post_steps, int) or self.max_post_steps < 0:
      raise ValueError(f"JointThresholdDecoder.max_post_steps: must be an int >= 0 (got {self.max_post_steps!r})")

  @classmethod
  def from_config(cls, gcfg: Any, *, vocab_size: int) -> "JointThresholdDecoder":
    return cls(max_post_steps=gcfg.max_post_steps)

  @classmethod
  def check_knobs(cls, values: Mapping[str, Any], owner: str) -> None:
    super().check_knobs(values, owner)
    check_real(values, "edit_threshold", owner, 0.0, None)

  @classmethod
  def check_config(cls, gcfg: Any) -> None:
    super().check_config(gcfg)
    cls(max_post_steps=gcfg.max_post_steps)  # its own validation, named
    if gcfg.temperature:
      raise ValueError(f"GenerationConfig.temperature={gcfg.temperature!r}: the joint_threshold decoder is "
                       "greedy (its edits compare argmaxes); set temperature=0")

  def max_steps(self, block_len: int) -> int:
    return block_len + self.max_post_steps + 1

  def init_state(self, tokens: jax.Array, maskable: jax.Array) -> JointThresholdState:
    b, l = tokens.shape
    return JointThresholdState(jnp.zeros((b, l), bool), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool),
                               jnp.zeros((), jnp.int32))

  def block_active(self, state: JointThresholdState, tokens: jax.Array, maskable: jax.Array, *,
                   mask_id: int) -> jax.Array:
    """[B]: rows whose block has not settled yet; a block with no mask when it starts (all prompt, or past
    the row's canvas) never takes a step."""
    started = state.calls > 0
    return ~state.finished & (started | (maskable & (tokens == mask_id)).any(axis=-1))

  def step(self, state: JointThresholdState, logits: jax.Array, tokens: jax.Array, maskable: jax.Array,
           knobs: JointThresholdKnobs, *, mask_id: int, temperature: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, JointThresholdState]:
    """One step; arguments and results as in `Decoder.step` (committed: the positions written, unmasked or
    edited)."""
    del temperature, rng  # greedy (check_config)
    z = logits.astype(jnp.float32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    z = jnp.where(vocab == mask_id, -jnp.inf, z)  # the mask guard: out of the argmax and of the softmax
    zmax, cand = common.max_and_argmax(z)
    p = 1.0 / jnp.sum(jnp.exp(z - zmax[..., None]), axis=-1)
    editable = jnp.where(state.calls == 0, maskable & (tokens == mask_id), state.editable)
    masked = editable & (tokens == mask_id)
    any_masked = masked.any(axis=-1)
    over = masked & (p > as_f32(knobs.threshold))
    m2t = over | (common.first_argmax(p, masked) & ~over.any(axis=-1, keepdims=True))
    post = state.post + (~any_masked).astype(jnp.int32)
    budget_exit = ~any_masked & (post > self.max_post_steps)
    t2t = editable & ~masked & (cand != tokens) & (p > as_f32(knobs.edit_threshold)) & ~budget_exit[:, None]
    write = (m2t | t2t) & ~state.finished[:, None]
    finished = state.finished | ~write.any(axis=-1)
    new = jnp.where(write, cand, tokens).astype(jnp.int32)
    return new, write, JointThresholdState(editable, post, finished, state.calls + 1)
