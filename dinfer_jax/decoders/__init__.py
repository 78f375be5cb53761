"""Parallel decoders: pure, jittable per-block token selection rules (dInfer's and the baselines)."""
from __future__ import annotations

import dataclasses

from dinfer_jax.decoders.baselines import FastDLLMDecoder, FixedStepsDecoder, FixedStepsState
from dinfer_jax.decoders.common import Decoder, Proposal, propose
from dinfer_jax.decoders.credit import CreditDecoder, CreditState
from dinfer_jax.decoders.hierarchy import HierarchyDecoder
from dinfer_jax.decoders.threshold import ThresholdDecoder

DECODERS = {
    "threshold": ThresholdDecoder,
    "hierarchy": HierarchyDecoder,
    "credit": CreditDecoder,
    "fixed_steps": FixedStepsDecoder,
    "fastdllm": FastDLLMDecoder,
}


def make_decoder(name: str, **knobs) -> Decoder:
  """Builds a decoder by name.

  Args:
    name: one of "threshold", "hierarchy", "credit", "fixed_steps", "fastdllm".
    **knobs: the decoder's dataclass fields, e.g. threshold=0.9, low_threshold=0.4,
      steps_per_block=8; the credit decoder also needs vocab_size.

  Returns:
    The frozen decoder instance.

  Raises:
    ValueError: unknown name, unknown knob, or a knob value the decoder rejects (naming it).
  """
  cls = DECODERS.get(name)
  if cls is None:
    raise ValueError(f"decoder name {name!r} is unknown; valid names: {', '.join(DECODERS)}")
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(knobs) - fields)
  if unknown:
    raise ValueError(f"{cls.__name__}: unknown knob(s) {', '.join(unknown)}; "
                     f"valid knobs: {', '.join(sorted(fields))}")
  try:
    return cls(**knobs)
  except TypeError as e:  # a missing required field
    raise ValueError(f"{cls.__name__}: {e}") from e


# GenerationConfig knob -> decoder field, for the knobs the engine passes as traced values.
KNOB_FIELDS = {"threshold": "threshold", "low_threshold": "low_threshold", "credit_alpha": "alpha",
               "credit_gamma": "gamma", "credit_beta": "beta"}


def with_knobs(decoder: Decoder, knobs: dict) -> Decoder:
  """The decoder with its knob fields set from `knobs` (GenerationConfig knob names -> traced fp32 scalars,
  inside the compiled program), so one program serves every value; fields the decoder lacks are ignored."""
  fields = {f.name for f in dataclasses.fields(decoder)}
  new = {field: knobs[knob] for knob, field in KNOB_FIELDS.items() if field in fields and knob in knobs}
  return dataclasses.replace(decoder, **new) if new else decoder


__all__ = [
    "DECODERS", "CreditDecoder", "CreditState", "Decoder", "FastDLLMDecoder", "FixedStepsDecoder",
    "FixedStepsState", "HierarchyDecoder", "KNOB_FIELDS", "Proposal", "ThresholdDecoder", "make_decoder",
    "propose", "with_knobs",
]
