"""GenerationConfig: every decoding knob, with dInfer's names, validated up front."""
from __future__ import annotations

import dataclasses

import numpy as np

DECODERS = ("threshold", "hierarchy", "credit", "fixed_steps", "fastdllm")
CACHES = ("none", "prefix", "dual")

# Iteration-smoothing schedule constants (dInfer's IterationSmooth defaults; only cont_weight is a knob there).
SMOOTH_WEIGHT_INIT = 0.15
SMOOTH_WEIGHT_GROWTH = 0.02
SMOOTH_THRESHOLD_DECAY = 0.02

# Knobs that are values in the compiled program, not part of its structure: the engine passes them as traced
# fp32 scalars (GenerationConfig.knob_values) and compiles for GenerationConfig.program_config, so a threshold
# sweep, a new temperature or a new smoothing cap reuses the program. Whether the program samples
# (temperature > 0) and whether it smooths (cont_weight > 0) are structure and stay in the program's key.
TRACED_KNOBS = ("threshold", "low_threshold", "credit_alpha", "credit_gamma", "credit_beta", "cont_weight",
                "temperature")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """Decoding settings. Hashable: the engine compiles one program per program_config() and shape bucket
  (the thresholds, temperature and smoothing cap are runtime values of that program: TRACED_KNOBS).

  Attributes:
    gen_length: generated positions per row (G).
    block_length: block size (B); blocks are decoded left to right.
    decoder: threshold | hierarchy | credit | fixed_steps (LLaDA's schedule) | fastdllm (top-1 + threshold).
    threshold: confidence threshold (threshold, credit, fastdllm; hierarchy's high threshold).
    low_threshold: hierarchy's per-run threshold.
    credit_alpha, credit_gamma, credit_beta: credit decoder's boost, exponent and decay.
    steps_per_block: fixed_steps' forwards per block.
    cache: none | prefix | dual.
    prefix_look, after_look, warmup_steps: the vicinity refresh (dual cache only): the cached step recomputes
      [s - prefix_look, e + after_look), and the first warmup_steps forwards are full forwards.
    cont_weight: iteration-smoothing cap; 0 disables smoothing.
    temperature: 0 = argmax; > 0 samples the token with Gumbel noise (confidence stays untempered).
    early_stop: after a block holding an EOS, fill the rest of that row with EOS and stop it.
    start_block_align: the first block starts at floor(P / B) * B instead of P (dInfer's benchmark default).
    mask_id, eos_id: default to the model config's.
    prompt_bucket: prompts are padded up to a multiple of this (one compiled program per bucket).
    dinfer_compat: run dInfer's exact forward sequence, forwards that cannot commit anything included: the
      cached step it owes after every refresh (even when the refresh committed the whole block), and block
      diffusion's clean-K/V forward after the last block or a block that ends the row with an EOS (whose
      K/V nothing reads). Off (the default), those forwards are skipped: the same tokens, fewer forwards.
      The parity tests against dInfer's traces set it.
  """
  gen_length: int = 128
  block_length: int = 32
  decoder: str = "threshold"
  threshold: float = 0.9
  low_threshold: float = 0.6
  credit_alpha: float = 0.7
  credit_gamma: float = 0.2
  credit_beta: float = 0.8
  steps_per_block: int = 0
  cache: str = "none"
  prefix_look: int = 0
  after_look: int = 0
  warmup_steps: int = 0
  cont_weight: float = 0.0
  temperature: float = 0.0
  early_stop: bool = True
  start_block_align: bool = False
  mask_id: int | None = None
  eos_id: int | None = None
  prompt_bucket: int = 32
  dinfer_compat: bool = False

  def __post_init__(self):
    def bad(knob, msg):
      raise ValueError(f"GenerationConfig.{knob}={getattr(self, knob)!r}: {msg}")

    for knob in ("gen_length", "block_length", "prompt_bucket"):
      v = getattr(self, knob)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        bad(knob, "must be a positive int")
    if self.decoder not in DECODERS:
      bad("decoder", f"unknown decoder; choose one of {', '.join(DECODERS)}")
    if self.cache not in CACHES:
      bad("cache", f"unknown cache mode; choose one of {', '.join(CACHES)}")
    if not 0.0 < self.threshold <= 1.0:
      bad("threshold", "must be in (0, 1]")
    if self.decoder == "hierarchy" and not 0.0 <= self.low_threshold <= 1.0:
      bad("low_threshold", "must be in [0, 1]")
    if self.decoder == "hierarchy" and self.low_threshold > self.threshold:
      bad("low_threshold", f"must not exceed threshold={self.threshold}")
    if self.decoder == "credit":
      if self.credit_alpha < 0:
        bad("credit_alpha", "must be >= 0")
      if self.credit_gamma <= 0:
        bad("credit_gamma", "must be > 0")
      if not 0.0 <= self.credit_beta <= 1.0:
        bad("credit_beta", "must be in [0, 1]")
    if self.decoder == "fixed_steps":
      if self.steps_per_block <= 0:
        bad("steps_per_block", "fixed_steps needs steps_per_block > 0")
      if self.steps_per_block > self.block_length:
        bad("steps_per_block", f"must not exceed block_length={self.block_length}")
      if self.gen_length % self.block_length:
        bad("block_length", f"fixed_steps needs block_length to divide gen_length={self.gen_length} "
                            "(LLaDA's schedule assumes equal blocks)")
    elif self.steps_per_block:
      bad("steps_per_block", "only the fixed_steps decoder uses steps_per_block")
    for knob in ("prefix_look", "after_look", "warmup_steps"):
      v = getattr(self, knob)
      if not isinstance(v, int) or v < 0:
        bad(knob, "must be an int >= 0")
    if self.vicinity and self.cache != "dual":
      bad("cache", "the vicinity refresh (prefix_look/after_look/warmup_steps > 0) needs cache='dual'")
    if not 0.0 <= self.cont_weight <= 1.0:
      bad("cont_weight", "must be in [0, 1] (0 disables iteration smoothing)")
    if self.temperature < 0:
      bad("temperature", "must be >= 0")

  def program_config(self) -> "GenerationConfig":
    """This config with every TRACED_KNOBS value replaced by a fixed one of the same structure: the
    compiled program's cache key (configs that differ only in knob values share it)."""
    return dataclasses.replace(self, threshold=1.0, low_threshold=0.0, credit_alpha=0.0, credit_gamma=1.0,
                               credit_beta=1.0, cont_weight=1.0 if self.smoothing else 0.0,
                               temperature=1.0 if self.temperature > 0 else 0.0)

  def knob_values(self) -> dict[str, np.ndarray]:
    """The TRACED_KNOBS as fp32 scalars: the compiled program's runtime arguments."""
    return {k: np.float32(getattr(self, k)) for k in TRACED_KNOBS}

  @property
  def vicinity(self) -> bool:
    return self.prefix_look > 0 or self.after_look > 0 or self.warmup_steps > 0

  @property
  def smoothing(self) -> bool:
    return self.cont_weight > 0

  def replace(self, **kw) -> "GenerationConfig":
    return dataclasses.replace(self, **kw)
