"""What decides a compiled generation program (DenoiseProgram, static) and what it takes as values (Knobs).

A DenoiseProgram is built once per request shape from the model config, the generation config and the
layout's grid. It is hashable: the jit static argument of engine.loop.run and the slots' step, and the key of
an engine.programs.ProgramCache. Knobs are the traced values (the decoder's thresholds, the temperature,
smoothing's cap): configs that differ only in those share one compiled program.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import flax.struct
import numpy as np

from dinfer_jax import decoders
from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import cache_policy
from dinfer_jax.engine.cache_policy import CachePolicy
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.layout import Grid


@dataclasses.dataclass(frozen=True)
class DenoiseProgram:
  """The static side of one generation program.

  Attributes:
    model: the model config (shapes of the forward).
    grid: the canvas geometry (engine.layout.Grid).
    decoder: the static decoder (decoders.Decoder; its knobs are in Knobs).
    cache: the cache policy (engine.cache_policy).
    smoothing: iteration smoothing (soft embeddings of the masked positions, a relaxing threshold).
    sampling: temperature > 0 (Gumbel noise chooses the token); else argmax.
    early_stop: an EOS in a finished block fills the rest of the row with EOS and ends it.
    mask_id, eos_id: the token ids (eos_id also fills a row that stopped early).
    stop_ids: every token that ends an answer (eos_id first; LLaDA2.2 adds <|role_end|>).
    dinfer_compat: run dInfer's exact forward sequence (GenerationConfig.dinfer_compat).
    stream: hand every finished block to a host callback while the program runs (engine.loop.register_stream).
  """

  model: ModelConfig
  grid: Grid
  decoder: decoders.Decoder
  cache: CachePolicy
  smoothing: bool
  sampling: bool
  early_stop: bool
  mask_id: int
  eos_id: int
  stop_ids: tuple[int, ...] = ()
  dinfer_compat: bool = False
  stream: bool = False

  @classmethod
  def build(cls, mcfg: ModelConfig, gcfg: GenerationConfig, grid: Grid,
            policy: CachePolicy | None = None) -> "DenoiseProgram":
    """The program of a config on a grid (policy: cache_policy.for_config(mcfg, gcfg), if already made)."""
    mask_id, eos_id = gcfg.token_ids(mcfg)
    return cls(model=mcfg, grid=grid, decoder=decoders.from_config(gcfg, vocab_size=mcfg.vocab_size),
               cache=policy if policy is not None else cache_policy.for_config(mcfg, gcfg),
               smoothing=gcfg.smoothing, sampling=gcfg.temperature > 0, early_stop=gcfg.early_stop,
               mask_id=mask_id, eos_id=eos_id, stop_ids=gcfg.stop_ids(mcfg), dinfer_compat=gcfg.dinfer_compat)

  def is_stop(self, tokens):
    """tokens == any of stop_ids (one comparison per id: with one id exactly tokens == eos_id)."""
    return functools.reduce(operator.or_, [tokens == t for t in self.stop_ids or (self.eos_id,)])

  def replace(self, **kw) -> "DenoiseProgram":
    return dataclasses.replace(self, **kw)


@flax.struct.dataclass
class Knobs:
  """The traced values of a program: decoder: the decoder's Knobs (its thresholds; smoothing relaxes the
  threshold per step); temperature: the sampling temperature (read only when the program samples);
  cont_weight: smoothing's cap on the soft-embedding weight (read only when it smooths)."""

  decoder: Any
  temperature: Any
  cont_weight: Any

  @classmethod
  def of(cls, gcfg: GenerationConfig) -> "Knobs":
    """A config's values as fp32 (or int32) numpy scalars: the program's runtime arguments."""
    return cls(decoder=decoders.get(gcfg.decoder).knobs_of(gcfg), temperature=np.float32(gcfg.temperature),
               cont_weight=np.float32(gcfg.cont_weight))
