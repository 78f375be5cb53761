"""A plain Python reference of dInfer's decoding loop (decoding.md, "Decisions for dinfer-jax"), batch 1.

Written independently of the engine (no engine loop/layout/cache/iteration code): one model forward per
iteration, python ints for every block and window bound, variable-width windows exactly as dInfer cuts
them, and a KV cache that is just the K/V arrays one full forward returned. It reuses the model's
`forward` (jitted per call, because an eager call of its lax.scan recompiles every time) and the decoder
objects' batch-1 `step`, except for LLaDA's fixed-steps schedule, which it writes out itself.

Semantics (decoding.md §0-§7, with the Decisions):
- canvas x = prompt | MASK * G, T = P + G; blocks [s, min(s + B, T)) from s0 = P (or floor(P / B) * B with
  start_block_align) while s < T;
- a block runs until it has no masks; NFE counts every forward; commit steps are 1-based forward indices;
- cache none: full forward x[0:T] every step;
- prefix / dual: at block entry a full refresh forward (its block logits decode), then cached steps on
  x[s:T] (prefix) or x[s:e] (dual) over the refresh's K/V; the first cached step after a refresh runs even
  when the refresh completed the block;
- vicinity (dual only): the first warmup_steps forwards of the generation are plain full forwards; the
  block's first post-warm-up iteration is its (single) refresh; cached steps run on the window
  [max(0, s - prefix_look), min(T, e + after_look));
- iteration smoothing: every forward reads soft embeddings; after each forward and decode, the positions
  the forward produced logits for get E[x] + w * softmax(z) @ E where still masked, E[x] otherwise; the
  decoder's threshold is max(1 - 0.02 n, threshold), w = min(0.15 + 0.02 n, cont_weight), n = forwards so far;
- decoder state (credit) is reset at every block;
- early stop: any EOS in a finished block fills [e, T) with EOS and ends the generation;
- LLaDA2 block diffusion (a cache): T padded to a multiple of B, s0 = floor(P / B) * B, a prefill forward
  on x[0:max(s0, B)) under the block-causal mask, then per block steps on x[s:e] attending to the cache
  [0, e) with the fresh K/V persisted every step, and one more forward on the finished block to store its
  clean K/V. LLaDA2 without a cache: a full forward on x[0:e] under the block-causal mask every step.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import decoders
from dinfer_jax.cache import KVCache
from dinfer_jax.model.transformer import forward

_forward = jax.jit(forward, static_argnames=("cfg", "logits_len", "moe_impl"))


@dataclasses.dataclass
class RefResult:
  canvas: list[int]  # the whole canvas (prompt, generated positions, early-stop fill), length T
  commit_step: list[int]  # per generated position x[P:], 1-based forward index, -1 never committed
  nfe: int
  forwards: list[tuple[str, int, int]]  # (kind, a, b): "full" / "refresh" / "cached" / "prefill" / "final"
  blocks: list[tuple[int, int]]


# ----------------------------------------------------------------------------- decoders

class _FixedSteps:
  """LLaDA's low-confidence schedule (decoding.md §1), written out: n_i = floor(m/S) + [i < m mod S]
  (the remainder goes to the earliest steps), commit the n_i most confident masked positions (lower
  index first on ties), m counted at the block's first step."""

  def __init__(self, steps: int):
    self.steps = steps

  def init_state(self, tokens, maskable):
    return {"m": None, "i": 0}

  def step(self, state, logits, tokens, maskable, *, mask_id, threshold=None, temperature=0.0, rng=None):
    prop = decoders.propose(logits, mask_id=mask_id, temperature=temperature, rng=rng)
    tok = np.asarray(tokens)[0]
    masked = (tok == mask_id) & np.asarray(maskable)[0]
    m = int(masked.sum()) if state["m"] is None else state["m"]
    i, S = state["i"], self.steps
    n = (m // S + (1 if i < m % S else 0)) if i < S else 0
    conf = np.where(masked, np.asarray(prop.conf)[0], -np.inf)
    order = np.argsort(-conf, kind="stable")  # descending, lower index first on ties
    commit = np.zeros_like(masked)
    commit[order[:n]] = True
    commit &= masked
    x0 = np.asarray(prop.token)[0]
    x0 = np.where(x0 == mask_id, np.asarray(prop.alt_token)[0], x0)
    new = np.where(commit, x0, tok)
    return jnp.asarray(new[None], jnp.int32), jnp.asarray(commit[None]), {"m": m, "i": i + 1}


def make_decoder(gcfg, vocab_size: int):
  """The decoder for a GenerationConfig, built from the decoder classes (not the engine's factory)."""
  name = gcfg.decoder
  if name == "threshold":
    return decoders.ThresholdDecoder(threshold=gcfg.threshold)
  if name == "hierarchy":
    return decoders.HierarchyDecoder(threshold=gcfg.threshold, low_threshold=gcfg.low_threshold)
  if name == "credit":
    return decoders.CreditDecoder(threshold=gcfg.threshold, alpha=gcfg.credit_alpha, gamma=gcfg.credit_gamma,
                                  beta=gcfg.credit_beta, vocab_size=vocab_size)
  if name == "fastdllm":
    return decoders.FastDLLMDecoder(threshold=gcfg.threshold)
  if name == "fixed_steps":
    return _FixedSteps(gcfg.steps_per_block)
  raise ValueError(name)


# ----------------------------------------------------------------------------- model calls

def _fwd(params, cfg, emb: np.ndarray, a: int, *, cache=None, mask=None):
  """One forward on input embeddings emb [n, D] sitting at canvas positions [a, a + n)."""
  n = emb.shape[0]
  kw = {}
  if cache is not None:
    kw = {"cache": cache, "cache_start": a}
  out = _forward(params, cfg, embeds=jnp.asarray(emb[None]), positions=jnp.arange(a, a + n, dtype=jnp.int32)[None],
                 mask=None if mask is None else jnp.asarray(mask[None]), **kw)
  return np.asarray(out.logits[0]), out.kv


def _soft(table, tokens: np.ndarray, logits: np.ndarray, mask_id: int, w: float) -> np.ndarray:
  """E[x] + w * softmax(z) @ E where x is MASK, E[x] elsewhere (decoding.md §5, H2Embed, tau 1)."""
  E = jnp.asarray(table)
  base = E[jnp.asarray(tokens)]
  p = jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  soft = jnp.einsum("wv,vd->wd", p.astype(E.dtype), E, preferred_element_type=jnp.float32)
  masked = jnp.asarray(tokens == mask_id)[:, None]
  return np.asarray((base.astype(jnp.float32) + jnp.where(masked, jnp.float32(w) * soft, 0.0)).astype(E.dtype))


def _block_causal(n: int, B: int) -> np.ndarray:
  blk = np.arange(n) // B
  return blk[:, None] >= blk[None, :]


# ----------------------------------------------------------------------------- the loop

def reference_generate(params, cfg, prompt, gcfg, *, mask_id: int | None = None,
                       eos_id: int | None = None) -> RefResult:
  """Runs one prompt through the reference loop.

  Args:
    params, cfg: model params and ModelConfig.
    prompt: list of token ids.
    gcfg: a GenerationConfig (only its knobs are read; temperature must be 0).
  """
  assert gcfg.temperature == 0, "the reference is greedy"
  mask_id = int(gcfg.mask_id if gcfg.mask_id is not None else (mask_id if mask_id is not None else cfg.mask_token_id))
  eos_id = int(gcfg.eos_id if gcfg.eos_id is not None else (eos_id if eos_id is not None else cfg.eos_token_id))
  if cfg.family == "llada2_moe":
    return _block_diffusion(params, cfg, list(prompt), gcfg, mask_id, eos_id)
  return _blockwise(params, cfg, list(prompt), gcfg, mask_id, eos_id)


def _blockwise(params, cfg, prompt, gcfg, mask_id, eos_id) -> RefResult:
  P, G, B = len(prompt), gcfg.gen_length, gcfg.block_length
  T = P + G
  x = np.array(prompt + [mask_id] * G, np.int64)
  commit = np.full(T, -1, np.int64)
  table = np.asarray(params["embed"])
  emb = table[x]  # the embeddings every forward reads: E[x], or the soft ones under smoothing
  smoothing = gcfg.cont_weight > 0
  vicinity = gcfg.prefix_look > 0 or gcfg.after_look > 0 or gcfg.warmup_steps > 0
  warmup = gcfg.warmup_steps if vicinity else 0
  dec = make_decoder(gcfg, cfg.vocab_size)
  s0 = (P // B) * B if gcfg.start_block_align else P
  n = 0
  forwards, blocks = [], []

  s = s0
  while s < T:
    e = min(s + B, T)
    blocks.append((s, e))
    state = dec.init_state(jnp.asarray(x[None, s:e], jnp.int32), jnp.ones((1, e - s), bool))
    cache = None  # this block's refresh snapshot
    owed_cached_step = False
    while (x[s:e] == mask_id).any() or owed_cached_step:
      thr = max(1.0 - 0.02 * n, gcfg.threshold) if smoothing else gcfg.threshold
      w = min(0.15 + 0.02 * n, gcfg.cont_weight)
      if not smoothing:
        emb = table[x]
      if gcfg.cache == "none" or n < warmup:
        logits, _ = _fwd(params, cfg, emb, 0)
        a, b, kind = 0, T, "full"
      elif cache is None:
        logits, cache = _fwd(params, cfg, emb, 0)
        a, b, kind = 0, T, "refresh"
        owed_cached_step = True
      else:
        if gcfg.cache == "prefix":
          a, b = s, T
        elif vicinity:
          a, b = max(0, s - gcfg.prefix_look), min(T, e + gcfg.after_look)
        else:
          a, b = s, e
        logits, _ = _fwd(params, cfg, emb[a:b], a, cache=cache)  # fresh K/V used for this forward only
        kind = "cached"
        owed_cached_step = False
      forwards.append((kind, a, b))
      n += 1
      blk_logits = logits[s - a:e - a]
      new, committed, state = dec.step(state, jnp.asarray(blk_logits[None]), jnp.asarray(x[None, s:e], jnp.int32),
                                       jnp.ones((1, e - s), bool), mask_id=mask_id,
                                       threshold=jnp.float32(thr), temperature=0.0, rng=None)
      new, committed = np.asarray(new)[0], np.asarray(committed)[0]
      assert not (committed & (x[s:e] != mask_id)).any(), "a decoder committed a decoded position"
      x[s:e] = np.where(committed, new, x[s:e])
      commit[s:e] = np.where(committed, n, commit[s:e])
      if smoothing:
        emb[a:b] = _soft(table, x[a:b], logits, mask_id, w)
    if (x[s:e] == eos_id).any() and gcfg.early_stop:
      x[e:] = eos_id
      break
    s += B
  return RefResult(x.tolist(), commit[P:].tolist(), n, forwards, blocks)


def _block_diffusion(params, cfg, prompt, gcfg, mask_id, eos_id) -> RefResult:
  assert gcfg.cont_weight == 0
  P, G, B = len(prompt), gcfg.gen_length, gcfg.block_length
  T = math.ceil((P + G) / B) * B
  x = np.array(prompt + [mask_id] * (T - P), np.int64)
  commit = np.full(T, -1, np.int64)
  table = np.asarray(params["embed"])
  dec = make_decoder(gcfg, cfg.vocab_size)
  s0 = (P // B) * B
  n = 0
  forwards, blocks = [], []
  use_cache = gcfg.cache != "none"

  kv = None
  if use_cache:
    pre = max(s0, B)
    _, kv = _fwd(params, cfg, table[x[:pre]], 0, mask=_block_causal(pre, B))
    n += 1
    forwards.append(("prefill", 0, pre))

  def decode(state, logits, s, e):
    new, committed, state = dec.step(state, jnp.asarray(logits[None]), jnp.asarray(x[None, s:e], jnp.int32),
                                     jnp.ones((1, e - s), bool), mask_id=mask_id,
                                     threshold=jnp.float32(gcfg.threshold), temperature=0.0, rng=None)
    new, committed = np.asarray(new)[0], np.asarray(committed)[0]
    assert not (committed & (x[s:e] != mask_id)).any()
    x[s:e] = np.where(committed, new, x[s:e])
    commit[s:e] = np.where(committed, n, commit[s:e])
    return state

  s = s0
  while s < T:
    e = s + B
    blocks.append((s, e))
    state = dec.init_state(jnp.asarray(x[None, s:e], jnp.int32), jnp.ones((1, e - s), bool))
    if use_cache:
      # extend_cache: the cache covers exactly [0, e); slots not yet written are zeros.
      have = kv.k.shape[2]
      if have < e:
        pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, e - have), (0, 0), (0, 0)))
        kv = KVCache(pad(kv.k), pad(kv.v))
      else:
        kv = KVCache(kv.k[:, :, :e], kv.v[:, :, :e])
    last_input_had_masks = False
    while (x[s:e] == mask_id).any():
      last_input_had_masks = True
      if use_cache:
        logits, kv = _fwd(params, cfg, table[x[s:e]], s, cache=kv)  # fresh K/V persisted
        forwards.append(("cached", s, e))
      else:
        logits, _ = _fwd(params, cfg, table[x[:e]], 0, mask=_block_causal(e, B))
        logits = logits[s:e]
        forwards.append(("full", 0, e))
      n += 1
      state = decode(state, logits, s, e)
    if use_cache and last_input_had_masks:
      logits, kv = _fwd(params, cfg, table[x[s:e]], s, cache=kv)  # clean K/V of the finished block
      forwards.append(("final", s, e))
      n += 1
      state = decode(state, logits, s, e)  # commits nothing: the block has no masks
    if (x[s:e] == eos_id).any() and gcfg.early_stop:
      x[e:] = eos_id
      break
    s += B
  return RefResult(x.tolist(), commit[P:].tolist(), n, forwards, blocks)
