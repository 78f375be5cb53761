"""GenerationConfig: every decoding knob, with dInfer's names, validated up front."""
from __future__ import annotations

import dataclasses

from dinfer_jax import decoders

CACHES = ("none", "prefix", "dual")

# Iteration-smoothing schedule constants (dInfer's IterationSmooth defaults; only cont_weight is a knob there).
SMOOTH_WEIGHT_INIT = 0.15
SMOOTH_WEIGHT_GROWTH = 0.02
SMOOTH_THRESHOLD_DECAY = 0.02


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """Decoding settings, validated up front. The engine compiles one program per engine.program.DenoiseProgram
  (what of this config shapes the program) and passes the rest as traced values (engine.program.Knobs: the
  decoder's thresholds, the temperature and the smoothing cap), so a sweep over those reuses one program.

  Attributes:
    gen_length: generated positions per row (G).
    block_length: block size (B); blocks are decoded left to right.
    decoder: a registered decoder (dinfer_jax.decoders.names()): threshold | hierarchy | credit |
      fixed_steps (LLaDA's schedule) | fastdllm (top-1 + threshold) | joint_threshold (LLaDA2.1's unmasking
      plus token editing) | entropy (d3LLM's entropy bound).
    threshold: confidence threshold (threshold, credit, fastdllm; hierarchy's high threshold).
    low_threshold: hierarchy's per-run threshold.
    credit_alpha, credit_gamma, credit_beta: credit decoder's boost, exponent and decay.
    edit_threshold: joint_threshold's token-to-token edit threshold (strict >; 0 edits wherever the argmax
      differs, >= 1 turns editing off).
    max_post_steps: joint_threshold's post-fill edit budget (steps that start with no mask, per block).
    entropy_threshold: the entropy decoder's bound in nats (strict <).
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
  edit_threshold: float = 0.0
  max_post_steps: int = 16
  entropy_threshold: float = 0.95
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
    if self.decoder not in decoders.names():
      bad("decoder", f"unknown decoder; choose one of {', '.join(decoders.names())}")
    if self.cache not in CACHES:
      bad("cache", f"unknown cache mode; choose one of {', '.join(CACHES)}")
    decoders.get(self.decoder).check_config(self)  # its knobs (every decoder's threshold in (0, 1])
    # A knob that shapes another decoder's program is a mistake, not something to ignore.
    for knob, owner in decoders.base.static_fields().items():
      if owner != self.decoder and getattr(self, knob) != _DEFAULTS[knob]:
        bad(knob, f"only the {owner} decoder uses {knob}")
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

  def with_preset(self, name: str) -> "GenerationConfig":
    """This config with the decoder's named preset of knobs (e.g. joint_threshold's "S" or "Q")."""
    presets = decoders.get(self.decoder).PRESETS
    if name not in presets:
      raise ValueError(f"GenerationConfig.decoder={self.decoder!r}: no preset {name!r}; its presets: "
                       f"{', '.join(presets) or 'none'}")
    return self.replace(**presets[name])

  def stop_ids(self, mcfg) -> tuple[int, ...]:
    """The tokens that end an answer: this config's eos_id alone, else the model's stop tokens."""
    return (int(self.eos_id),) if self.eos_id is not None else tuple(mcfg.stop_token_ids)

  def token_ids(self, mcfg) -> tuple[int, int]:
    """(mask id, EOS id): this config's, else the model config's."""
    mask_id = self.mask_id if self.mask_id is not None else mcfg.mask_token_id
    eos_id = self.eos_id if self.eos_id is not None else mcfg.eos_token_id
    return int(mask_id), int(eos_id)

  @property
  def vicinity(self) -> bool:
    return self.prefix_look > 0 or self.after_look > 0 or self.warmup_steps > 0

  @property
  def smoothing(self) -> bool:
    return self.cont_weight > 0

  def replace(self, **kw) -> "GenerationConfig":
    return dataclasses.replace(self, **kw)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}
