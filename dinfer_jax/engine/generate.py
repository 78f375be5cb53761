"""Host side of generation: prompts -> canvas layout -> one jitted program -> per-row results."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import decoders
from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import loop
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.layout import Layout, make_layout, normalize_prompts
from dinfer_jax.model import params as params_lib
from dinfer_jax.sharding import use_mesh


@dataclasses.dataclass
class GenerationResult:
  """Per-row results of one generate call.

  tokens: generated tokens before the first EOS (what a user reads, and what TPS counts).
  canvas: prompt followed by every generated position (after the early-stop EOS fill), no padding.
  commit_step: per generated position, the row's 1-based forward index that committed it; -1 = never
    (filled by early stop).
  num_tokens: len(tokens) per row. nfe: model forwards executed by the call (a forward batched over rows
    counts once). row_nfe: forwards each row took part in (equals its NFE when run alone).
  """
  tokens: list[list[int]]
  canvas: list[list[int]]
  commit_step: list[list[int]]
  num_tokens: list[int]
  nfe: int
  row_nfe: list[int]
  prompt_lengths: list[int]
  forward_counts: dict[str, int]


def count_generated(generated: Sequence[int], eos_id: int) -> int:
  """The token counter for TPS/TPF (decoding.md Decisions §8): generated tokens before the first EOS."""
  for i, t in enumerate(generated):
    if t == eos_id:
      return i
  return len(generated)


def decoder_for(gcfg: GenerationConfig, vocab_size: int):
  """The decoder policy object (static in the compiled program) for a generation config."""
  if gcfg.decoder == "threshold":
    return decoders.ThresholdDecoder(threshold=gcfg.threshold)
  if gcfg.decoder == "hierarchy":
    return decoders.HierarchyDecoder(threshold=gcfg.threshold, low_threshold=gcfg.low_threshold)
  if gcfg.decoder == "credit":
    return decoders.CreditDecoder(threshold=gcfg.threshold, alpha=gcfg.credit_alpha, gamma=gcfg.credit_gamma,
                                  beta=gcfg.credit_beta, vocab_size=vocab_size)
  if gcfg.decoder == "fixed_steps":
    return decoders.FixedStepsDecoder(steps_per_block=gcfg.steps_per_block)
  return decoders.FastDLLMDecoder(threshold=gcfg.threshold)


def engine_mode(mcfg: ModelConfig, gcfg: GenerationConfig) -> tuple[str, bool]:
  """(mode, block_causal). LLaDA2 decodes by block diffusion (decoding.md §6d): with any cache the
  block-diffusion prefix cache, without one full forwards under the block-causal mask."""
  if mcfg.family == "llada2_moe":
    if gcfg.smoothing:
      raise ValueError("GenerationConfig.cont_weight: iteration smoothing is not supported with LLaDA2's "
                       "block diffusion; set cont_weight=0")
    if gcfg.vicinity:
      raise ValueError("GenerationConfig.prefix_look/after_look/warmup_steps: the vicinity refresh does not "
                       "apply to LLaDA2's block diffusion (its cache is exact); set them to 0")
    return ("none", True) if gcfg.cache == "none" else ("block_diffusion", False)
  return gcfg.cache, False


def batch_bucket(n: int) -> int:
  """Rows of the compiled program for n prompts: powers of two up to 16, then multiples of 16, so a new
  batch size reuses a compiled program (the extra rows stay invalid: they never decode and cost no NFE)."""
  if n <= 16:
    return 1 << (n - 1).bit_length()
  return -(-n // 16) * 16


def prepare(mcfg: ModelConfig, prompts, gcfg: GenerationConfig) -> tuple[Layout, dict[str, Any]]:
  """Validates and lays out the prompts; returns the layout and the static arguments of the program."""
  mode, block_causal = engine_mode(mcfg, gcfg)
  prompts = normalize_prompts(prompts)
  lay = make_layout(prompts, gcfg, mcfg, block_diffusion=block_causal or mode == "block_diffusion",
                    batch_bucket=batch_bucket(len(prompts)))
  mask_id = gcfg.mask_id if gcfg.mask_id is not None else mcfg.mask_token_id
  eos_id = gcfg.eos_id if gcfg.eos_id is not None else mcfg.eos_token_id
  static = dict(mcfg=mcfg, gcfg=gcfg, grid=lay.grid, decoder=decoder_for(gcfg, mcfg.vocab_size), mode=mode,
                block_causal=block_causal, mask_id=int(mask_id), eos_id=int(eos_id))
  return lay, static


_LAST_UNSTACKED: list = []  # [(stacked params, their per-layer layout)]: the last params generate saw


def inference_params(params: dict) -> dict:
  """The per-layer layout the program runs on (params_lib.unstack_layers), made once per params object:
  the last one is kept next to the stacked params (weights memory x2) so repeated calls reuse it."""
  if params_lib.is_unstacked(params):
    return params
  if _LAST_UNSTACKED and _LAST_UNSTACKED[0][0] is params:
    return _LAST_UNSTACKED[0][1]
  un = params_lib.unstack_layers(params)
  _LAST_UNSTACKED[:] = [(params, un)]
  return un


def generate_arrays(params: dict, mcfg: ModelConfig, prompts, gcfg: GenerationConfig, *, seed: int = 0):
  """Runs the program; returns (layout, device outputs) without host post-processing (for benchmarks)."""
  lay, static = prepare(mcfg, prompts, gcfg)
  out = loop.run_jit()(inference_params(params), jnp.asarray(lay.canvas), jnp.asarray(lay.valid), jnp.asarray(lay.positions),
                       jax.random.PRNGKey(seed), **static)
  return lay, out, static


def collect(lay: Layout, out: dict, n_rows: int, eos_id: int) -> GenerationResult:
  canvas = np.asarray(out["canvas"])
  commit = np.asarray(out["commit"])
  row_nfe = np.asarray(out["row_nfe"])
  res = GenerationResult([], [], [], [], int(out["nfe"]), [], [], {"full": int(out["n_full"]),
                                                                      "cached": int(out["n_cached"])})
  for r in range(n_rows):
    pad, P, end = int(lay.pad[r]), int(lay.prompt_len[r]), int(lay.end[r])
    row = canvas[r, pad:end].tolist()
    gen = row[P:]
    k = count_generated(gen, eos_id)
    res.canvas.append(row)
    res.tokens.append(gen[:k])
    res.num_tokens.append(k)
    res.commit_step.append(commit[r, pad + P:end].tolist())
    res.row_nfe.append(int(row_nfe[r]))
    res.prompt_lengths.append(P)
  return res


def generate(model, prompts, config: GenerationConfig | None = None, *, seed: int = 0) -> GenerationResult:
  """Generates for a batch of prompts (a list of token-id lists, ragged, or one list).

  Args:
    model: a dinfer_jax Model (from dinfer_jax.load) or a (params, ModelConfig) pair.
    config: GenerationConfig (default GenerationConfig()).
    seed: PRNG seed for temperature sampling; same seed, same output.
  """
  params, mcfg = (model.params, model.config) if hasattr(model, "params") else model
  gcfg = config or GenerationConfig()
  prompts = normalize_prompts(prompts)
  with use_mesh(getattr(model, "mesh", None)):
    lay, out, static = generate_arrays(params, mcfg, prompts, gcfg, seed=seed)
  return collect(lay, out, len(prompts), static["eos_id"])
