"""Checks the CLI runs around a generate call, so that failures say what is wrong instead of crashing.

  check_ids(model, gcfg, source)          --mask-id / --eos-id inside the vocabulary
  check_fits(model, prompts, gcfg)        the canvas of this call fits in device memory (before compiling)
  check_weights(model)                    NaN/inf weights are reported (they make every logit NaN, and the
                                          answer silently empty or garbage), naming the tensors (load
                                          refuses them already, unless allow_nonfinite)
  check_finite(model, prompts, gcfg, res) NaN/inf logits behind an empty answer are reported

Each raises ValueError with a one-line message (the CLI prints it as `error: ...`, exit status 2).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import api
from dinfer_jax.engine import generate as gen_lib
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.model import params as params_lib

GIB = 2**30


def check_ids(model, gcfg: GenerationConfig, source: dict[str, str] | None = None) -> None:
  """mask_id / eos_id must be token ids of the model; `source` maps a knob to where its value came from."""
  V = model.config.vocab_size
  for knob in ("mask_id", "eos_id"):
    v = getattr(gcfg, knob)
    if v is not None and not 0 <= v < V:
      where = (source or {}).get(knob, f"--{knob.replace('_', '-')}")
      raise ValueError(f"{where}: {knob}={v} is outside the model's vocabulary [0, {V})")


def available_bytes(device=None) -> int | None:
  """Memory a new program may still use on `device` (host RAM for CPU devices); None if unknown."""
  device = device or jax.devices()[0]
  if device.platform != "cpu":
    try:
      stats = device.memory_stats() or {}
      return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    except (KeyError, TypeError, AttributeError, RuntimeError):
      return None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):
    return None


def canvas_bytes(mcfg, rows: int, length: int, weight_itemsize: int) -> int:
  """A lower bound on the peak working memory of one program over a [rows, length] canvas.

  The full forward of the first step materialises one layer's fp32 attention scores and their softmax
  ([rows, N, T, T] each), fp32 logits [rows, T, V] and the K/V cache of every layer.
  """
  scores = 2 * rows * mcfg.n_heads * length * length * 4
  logits = rows * length * mcfg.vocab_size * 4
  kv = 2 * mcfg.n_layers * rows * length * mcfg.n_kv_heads * mcfg.head_dim * weight_itemsize
  return scores + logits + kv


def _weight_itemsize(model) -> int:
  leaves = jax.tree_util.tree_leaves(model.params)
  return max((np.dtype(x.dtype).itemsize for x in leaves), default=4)


def check_fits(model, prompts: Sequence[Sequence[int]], gcfg: GenerationConfig, *, available: int | None = None,
               source: str = "--gen-length") -> None:
  """Refuses a call whose canvas cannot fit, before anything is compiled, and says what gen_length fits."""
  lay, _ = gen_lib.prepare(model.config, prompts, gcfg)
  rows, length = lay.canvas.shape
  avail = available_bytes() if available is None else available
  item = _weight_itemsize(model)
  need = canvas_bytes(model.config, rows, length, item)
  if avail is None or need <= avail:
    return
  other = length - gcfg.gen_length  # prompt bucket and block padding
  fits, lo, hi = 0, 1, gcfg.gen_length
  while lo <= hi:  # canvas_bytes grows with the length: the largest gen_length that fits
    mid = (lo + hi) // 2
    if canvas_bytes(model.config, rows, other + mid, item) <= avail:
      fits, lo = mid, mid + 1
    else:
      hi = mid - 1
  B = gcfg.block_length
  fits = (fits // B) * B if fits >= B else fits
  hint = (f"at most about gen_length={fits} fits with {rows} prompt(s)" if fits
          else "not even one block fits; use fewer prompts or a smaller model")
  raise ValueError(f"{source}: gen_length={gcfg.gen_length} needs about {need / GIB:.1f} GiB for a canvas of "
                   f"{rows} x {length} positions, but only {avail / GIB:.1f} GiB are available on "
                   f"{jax.devices()[0].platform}; {hint}")


def check_weights(model) -> None:
  """Refuses a model whose weights hold NaN/inf (one loaded with allow_nonfinite, or params made in
  process): its logits would be NaN and every answer meaningless."""
  bad = params_lib.nonfinite_weights(model.params)
  if bad:
    where = f" at {model.path}" if model.path else ""
    raise ValueError(f"the model{where} {params_lib.describe_nonfinite(bad)}")


def check_finite(model, prompts: Sequence[Sequence[int]], gcfg: GenerationConfig, result: Any) -> None:
  """An empty answer from NaN/inf logits (with finite weights: an overflow) is not an answer: say so.

  Runs only for rows whose answer is empty (an ordinary answer costs nothing): one plain forward of that
  row's prompt followed by gen_length masks.
  """
  empty = [r for r, t in enumerate(result.tokens) if not t]
  if not empty:
    return
  mask_id = gcfg.token_ids(model.config)[0]
  for r in empty:
    row = list(prompts[r]) + [mask_id] * gcfg.gen_length
    row = row[:model.config.max_position]
    logits = api.forward(model, [row])
    if bool(jnp.all(jnp.isfinite(logits))):
      continue
    check_weights(model)
    raise ValueError(f"the model's logits are NaN/inf for prompt {r} although its weights are finite (an overflow "
                     "in the weight dtype?); try --dtype float32")
