"""d3LLM's entropy-bounded decoder (EntropyThreshold): the lowest-entropy masked position always, plus every
masked position whose prediction entropy is under a bound. Training-free, for every model family."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp

from dinfer_jax.decoders import common
from dinfer_jax.decoders.base import Decoder, Knobs, as_f32, check_real, register

# d3LLM's guard inside the log: H = -sum p log(p + eps).
ENTROPY_EPS = 1e-8


def entropy(z: jax.Array) -> jax.Array:
  """[B, L] fp32 entropy (nats) of softmax(z) of fp32 logits z [B, L, V]: -sum p log(p + 1e-8)."""
  p = jax.nn.softmax(z, axis=-1)
  return -jnp.sum(p * jnp.log(p + ENTROPY_EPS), axis=-1)


@flax.struct.dataclass
class EntropyKnobs(Knobs):
  """entropy_threshold: the bound in nats (strict <; d3LLM's default 0.95). threshold is unused."""
  entropy_threshold: Any = 0.95


@register("entropy")
@dataclasses.dataclass(frozen=True)
class EntropyDecoder(Decoder):
  """Per row: the masked position of lowest entropy (lowest index on ties) and every masked position with
  H < entropy_threshold commit their argmax (the best non-mask token where the argmax is the mask).
  Stateless."""

  Knobs = EntropyKnobs

  @classmethod
  def check_knobs(cls, values: Mapping[str, Any], owner: str) -> None:
    super().check_knobs(values, owner)
    check_real(values, "entropy_threshold", owner, 0.0, None)

  def step(self, state: tuple[()], logits: jax.Array, tokens: jax.Array, maskable: jax.Array,
           knobs: EntropyKnobs, *, mask_id: int, temperature: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, tuple[()]]:
    """One step; arguments and results as in `Decoder.step`."""
    z = logits.astype(jnp.float32)
    prop = common.propose(z, mask_id=mask_id, temperature=temperature, rng=rng)
    masked = common.masked_positions(tokens, maskable, mask_id)
    h = entropy(z)
    commit = (masked & (h < as_f32(knobs.entropy_threshold))) | common.first_argmax(-h, masked)
    return common.write_tokens(tokens, commit, prop, mask_id), commit, state
