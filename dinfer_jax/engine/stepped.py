"""The decoding loop driven step by step from Python, batch 1 (docs/design.md).

Two uses, one copy of the logic:
- the tests' plain reference (`reference_generate`, runner REFERENCE): written independently of the engine
  (no engine loop/layout/cache/iteration code): one model forward per iteration, python ints for every
  block and window bound, variable-width windows exactly as dInfer cuts them, and a KV cache that is just
  the K/V arrays one full forward returned. It reuses the model's `forward` (jitted per call, because an
  eager call of its lax.scan recompiles every time) and the decoder objects' batch-1 `step` (run eagerly),
  except for LLaDA's fixed-steps schedule, which it writes out itself in numpy;
- the benchmark's Python-stepped baseline (`stepped_generate(..., runner=JitRunner())`): the same loop the
  way dInfer and Fast-dLLM run it: one jitted forward per step (one compiled program per distinct input
  shape, cached), a jitted decoder step, only the block's logits computed when no smoothing needs the
  others, and a host sync every step (the `while block has masks` test reads the canvas on the host).

Semantics (docs/design.md, D1-D9):
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
from dinfer_jax.model import quant
from dinfer_jax.model.transformer import forward

_forward = jax.jit(forward, static_argnames=("cfg", "logits_len", "moe_impl"))


@dataclasses.dataclass
class RefResult:
  canvas: list[int]  # the whole canvas (prompt, generated positions, early-stop fill), length T
  commit_step: list[int]  # per generated position x[P:], 1-based forward index, -1 never committed
  nfe: int
  forwards: list[tuple[str, int, int]]  # (kind, a, b): "full" / "refresh" / "cached" / "prefill" / "final"
  blocks: list[tuple[int, int]]
  forward_block: list[int] = dataclasses.field(default_factory=list)  # per forward, its block's index (-1: prefill)
  # per forward, what its decode wrote: {"unmasked": [(pos, token)], "edited": [(pos, old, new)]} (canvas positions)
  writes: list[dict] = dataclasses.field(default_factory=list)


# ----------------------------------------------------------------------------- decoders

class _FixedSteps:
  """LLaDA's low-confidence schedule (docs/design.md, D5), written out: n_i = floor(m/S) + [i < m mod S]
  (the remainder goes to the earliest steps), commit the n_i most confident masked positions (lower
  index first on ties), m counted at the block's first step."""

  def __init__(self, steps: int):
    self.steps = steps

  def init_state(self, tokens, maskable):
    return {"m": None, "i": 0}

  def step(self, state, logits, tokens, maskable, knobs, *, mask_id, temperature=0.0, rng=None):
    del knobs
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


class _JointThreshold:
  """LLaDA2.1's unmask-and-edit step (docs/design.md, D13), written out in numpy: the mask token out of the
  argmax and the softmax; M2T = masked with p > threshold, else the most confident masked position; a step
  that starts with no mask counts toward the budget and past it ends the block writing nothing; T2T =
  generated, unmasked positions whose argmax differs with p > edit_threshold; nothing written: stable."""
  settles, edits = True, True

  def __init__(self, max_post_steps: int):
    self.budget = max_post_steps

  def init_state(self, tokens, maskable):
    return {"editable": None, "post": 0, "finished": False}

  def active(self, state, tokens, mask_id) -> bool:
    if state["editable"] is None:  # a block that starts with no mask never takes a step
      return bool((np.asarray(tokens) == mask_id).any())
    return not state["finished"]

  def step(self, state, logits, tokens, maskable, knobs, *, mask_id, temperature=0.0, rng=None):
    z = np.array(logits, np.float32)[0]
    z[:, mask_id] = -np.inf
    cand = z.argmax(-1)
    zmax = z.max(-1, keepdims=True)
    p = (1.0 / np.exp(z - zmax).sum(-1)).astype(np.float32)
    tok = np.asarray(tokens)[0]
    editable = (tok == mask_id) & np.asarray(maskable)[0] if state["editable"] is None else state["editable"]
    masked = editable & (tok == mask_id)
    write = np.zeros_like(masked)
    post = state["post"]
    if masked.any():
      write = masked & (p > np.float32(knobs.threshold))
      if not write.any():
        write[np.flatnonzero(masked)[np.argmax(p[masked])]] = True
    else:
      post += 1
    if masked.any() or post <= self.budget:
      write |= editable & ~masked & (cand != tok) & (p > np.float32(knobs.edit_threshold))
    new = np.where(write, cand, tok)
    state = {"editable": editable, "post": post, "finished": not write.any()}
    return jnp.asarray(new[None], jnp.int32), jnp.asarray(write[None]), state


def make_decoder(gcfg, vocab_size: int, *, independent_fixed_steps: bool = True):
  """The registry's decoder for a GenerationConfig (decoders.from_config), except that with
  independent_fixed_steps LLaDA's schedule and the unmask-and-edit step are the ones written out above in numpy
  (the reference's own check of the package's jittable decoders)."""
  if gcfg.decoder == "fixed_steps" and independent_fixed_steps:
    return _FixedSteps(gcfg.steps_per_block)
  if gcfg.decoder == "joint_threshold" and independent_fixed_steps:
    return _JointThreshold(gcfg.max_post_steps)
  return decoders.from_config(gcfg, vocab_size=vocab_size)


def _block_pending(dec, state, tokens: np.ndarray, mask_id: int) -> bool:
  """Whether the block needs another step: it holds a mask, or a decoder that settles its blocks says so."""
  if not getattr(dec, "settles", False):
    return bool((tokens == mask_id).any())
  if isinstance(dec, _JointThreshold):
    return dec.active(state, tokens, mask_id)
  active = dec.block_active(state, jnp.asarray(tokens[None], jnp.int32), jnp.ones((1, len(tokens)), bool),
                            mask_id=mask_id)
  return bool(np.asarray(active)[0])


def _writes(before: np.ndarray, after: np.ndarray, committed: np.ndarray, s: int, mask_id: int) -> dict:
  pos = np.flatnonzero(committed)
  return {"unmasked": [(s + int(j), int(after[j])) for j in pos if before[j] == mask_id],
          "edited": [(s + int(j), int(before[j]), int(after[j])) for j in pos if before[j] != mask_id]}


# ----------------------------------------------------------------------------- how the model and decoder run

def _soft(table, tokens: np.ndarray, logits, mask_id: int, w: float) -> np.ndarray:
  """E[x] + w * softmax(z) @ E where x is MASK, E[x] elsewhere (docs/design.md, D6); an 8-bit
  table is dequantised first."""
  E = jnp.asarray(quant.dequantize(table, table.dtype))
  base = E[jnp.asarray(tokens)]
  p = jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  soft = jnp.einsum("wv,vd->wd", p.astype(E.dtype), E, preferred_element_type=jnp.float32)
  masked = jnp.asarray(tokens == mask_id)[:, None]
  return (base.astype(jnp.float32) + jnp.where(masked, jnp.float32(w) * soft, 0.0)).astype(E.dtype)


def _fwd(params, cfg, emb: np.ndarray, a: int, *, cache=None, mask=None):
  """One forward on input embeddings emb [n, D] sitting at canvas positions [a, a + n); host logits, K/V."""
  n = emb.shape[0]
  kw = {}
  if cache is not None:
    kw = {"cache": cache, "cache_start": a}
  out = _forward(params, cfg, embeds=jnp.asarray(emb[None]), positions=jnp.arange(a, a + n, dtype=jnp.int32)[None],
                 mask=None if mask is None else jnp.asarray(mask[None]), **kw)
  return np.asarray(out.logits[0]), out.kv


class ReferenceRunner:
  """The tests' reference: forwards on host-side embeddings with logits for every input brought to the
  host, decoder steps and soft embeddings run eagerly, embeddings kept in numpy."""
  independent_fixed_steps = True

  def embed(self, params, x: np.ndarray):
    # A writable host copy: smoothing updates it in place.
    return np.array(quant.take_rows(params["embed"], jnp.asarray(x, jnp.int32)))

  def forward(self, params, cfg, tokens: np.ndarray, a: int, *, emb=None, cache=None, mask=None,
              logits_range=None):
    """One forward on the inputs at canvas positions [a, a + n) (emb [n, D] if given, else E[tokens]).
    Returns (logits of inputs [start, start + len) if logits_range=(start, len) else of all, K/V)."""
    if emb is None:
      emb = self.embed(params, tokens)
    logits, kv = _fwd(params, cfg, emb, a, cache=cache, mask=mask)
    if logits_range is not None:
      logits = logits[logits_range[0]:logits_range[0] + logits_range[1]]
    return logits, kv

  def init_state(self, dec, tokens: np.ndarray):
    return dec.init_state(jnp.asarray(tokens[None], jnp.int32), jnp.ones((1, tokens.shape[0]), bool))

  def decode(self, dec, state, logits, tokens: np.ndarray, knobs, *, mask_id: int, threshold: float):
    new, committed, state = dec.step(state, jnp.asarray(logits[None]), jnp.asarray(tokens[None], jnp.int32),
                                     jnp.ones((1, tokens.shape[0]), bool), knobs.replace(threshold=jnp.float32(threshold)),
                                     mask_id=mask_id, temperature=0.0, rng=None)
    return np.asarray(new)[0], np.asarray(committed)[0], state

  def smooth(self, params, emb, a: int, b: int, tokens: np.ndarray, logits, mask_id: int, w: float):
    emb[a:b] = np.asarray(_soft(params["embed"], tokens, logits, mask_id, w))
    return emb


@functools.partial(jax.jit, static_argnames=("cfg", "logits_len"))
def _jit_forward_tokens(params, tokens, positions, mask, cache, cache_start, logits_start, *, cfg, logits_len):
  return forward(params, cfg, tokens, positions=positions, mask=mask, cache=cache, cache_start=cache_start,
                 logits_start=logits_start, logits_len=logits_len)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _jit_forward_embeds(params, embeds, positions, mask, cache, cache_start, *, cfg):
  return forward(params, cfg, embeds=embeds, positions=positions, mask=mask, cache=cache, cache_start=cache_start)


@functools.partial(jax.jit, static_argnames=("dec", "mask_id"))
def _jit_step(state, logits, tokens, knobs, threshold, *, dec, mask_id):
  return dec.step(state, logits[None], tokens[None], jnp.ones((1, tokens.shape[0]), bool),
                  knobs.replace(threshold=threshold), mask_id=mask_id, temperature=0.0, rng=None)


@functools.partial(jax.jit, static_argnames=("dec",))
def _jit_init(tokens, *, dec):
  return dec.init_state(tokens[None], jnp.ones((1, tokens.shape[0]), bool))


@jax.jit
def _jit_smooth(table, emb, a, tokens, logits, mask_id, w):
  new = _soft(table, tokens, logits, mask_id, w)
  return jax.lax.dynamic_update_slice_in_dim(emb, new, a, axis=0)


class JitRunner:
  """The benchmark's Python-stepped driver (how dInfer and Fast-dLLM run): every forward, decoder step and
  smoothing update is a jitted call (compiled once per distinct shape and cached by jax.jit), the logits
  and the smoothed embeddings stay on the device, and each step syncs once with the host to read back the
  block's new tokens. Token inputs are embedded inside the jitted forward, and only the block's logits are
  computed when nothing else needs them, as in the engine."""
  independent_fixed_steps = False

  def embed(self, params, x: np.ndarray):
    return quant.take_rows(params["embed"], jnp.asarray(x, jnp.int32))

  def forward(self, params, cfg, tokens: np.ndarray, a: int, *, emb=None, cache=None, mask=None,
              logits_range=None):
    n = tokens.shape[0]
    pos = jnp.arange(a, a + n, dtype=jnp.int32)[None]
    m = None if mask is None else jnp.asarray(mask[None])
    start = None if cache is None else jnp.int32(a)
    if emb is None and logits_range is not None:
      out = _jit_forward_tokens(params, jnp.asarray(tokens[None], jnp.int32), pos, m, cache, start,
                                jnp.int32(logits_range[0]), cfg=cfg, logits_len=int(logits_range[1]))
      return out.logits[0], out.kv
    if emb is None:
      emb = self.embed(params, tokens)
    out = _jit_forward_embeds(params, emb[None], pos, m, cache, start, cfg=cfg)
    logits = out.logits[0]
    if logits_range is not None:
      logits = logits[logits_range[0]:logits_range[0] + logits_range[1]]
    return logits, out.kv

  def init_state(self, dec, tokens: np.ndarray):
    return _jit_init(jnp.asarray(tokens, jnp.int32), dec=dec)

  def decode(self, dec, state, logits, tokens: np.ndarray, knobs, *, mask_id: int, threshold: float):
    new, committed, state = _jit_step(state, logits, jnp.asarray(tokens, jnp.int32), knobs, jnp.float32(threshold),
                                      dec=dec, mask_id=mask_id)
    return np.asarray(new)[0], np.asarray(committed)[0], state  # the per-step host sync

  def smooth(self, params, emb, a: int, b: int, tokens: np.ndarray, logits, mask_id: int, w: float):
    return _jit_smooth(params["embed"], emb, jnp.int32(a), jnp.asarray(tokens, jnp.int32), logits,
                       jnp.int32(mask_id), jnp.float32(w))


REFERENCE = ReferenceRunner()


# ----------------------------------------------------------------------------- the loop

def _block_causal(n: int, B: int) -> np.ndarray:
  blk = np.arange(n) // B
  return blk[:, None] >= blk[None, :]


def stepped_generate(params, cfg, prompt, gcfg, *, mask_id: int | None = None, eos_id: int | None = None,
                     runner=None) -> RefResult:
  """Runs one prompt through the step-by-step loop.

  Args:
    params, cfg: model params and ModelConfig.
    prompt: list of token ids.
    gcfg: a GenerationConfig (only its knobs are read; temperature must be 0).
    runner: REFERENCE (default; the tests' reference) or a JitRunner (the benchmark's driver).
  """
  assert gcfg.temperature == 0, "the stepped loop is greedy"
  runner = runner or REFERENCE
  ids = gcfg.replace(mask_id=gcfg.mask_id if gcfg.mask_id is not None else mask_id,
                     eos_id=gcfg.eos_id if gcfg.eos_id is not None else eos_id)
  mask_id, eos_id = ids.token_ids(cfg)
  eos_id = ids.stop_ids(cfg) if len(ids.stop_ids(cfg)) > 1 else eos_id  # the ids that end a row
  if cfg.block_diffusion:
    return _block_diffusion(params, cfg, list(prompt), gcfg, mask_id, eos_id, runner)
  return _blockwise(params, cfg, list(prompt), gcfg, mask_id, eos_id, runner)


def reference_generate(params, cfg, prompt, gcfg, *, mask_id: int | None = None,
                       eos_id: int | None = None) -> RefResult:
  """The tests' plain reference loop (runner REFERENCE)."""
  return stepped_generate(params, cfg, prompt, gcfg, mask_id=mask_id, eos_id=eos_id, runner=REFERENCE)


def _blockwise(params, cfg, prompt, gcfg, mask_id, eos_id, runner) -> RefResult:
  P, G, B = len(prompt), gcfg.gen_length, gcfg.block_length
  T = P + G
  x = np.array(prompt + [mask_id] * G, np.int64)
  commit = np.full(T, -1, np.int64)
  smoothing = gcfg.cont_weight > 0
  # The embeddings every forward reads under smoothing (the soft ones); without it forwards read E[x].
  emb = runner.embed(params, x) if smoothing else None
  vicinity = gcfg.prefix_look > 0 or gcfg.after_look > 0 or gcfg.warmup_steps > 0
  warmup = gcfg.warmup_steps if vicinity else 0
  dec = make_decoder(gcfg, cfg.vocab_size, independent_fixed_steps=runner.independent_fixed_steps)
  knobs = decoders.get(gcfg.decoder).knobs_of(gcfg)
  s0 = (P // B) * B if gcfg.start_block_align else P
  n = 0
  forwards, blocks, fblock, writes = [], [], [], []

  s = s0
  while s < T:
    e = min(s + B, T)
    blocks.append((s, e))
    state = runner.init_state(dec, x[s:e])
    cache = None  # this block's refresh snapshot
    owed_cached_step = False
    while _block_pending(dec, state, x[s:e], mask_id) or owed_cached_step:
      thr = max(1.0 - 0.02 * n, gcfg.threshold) if smoothing else gcfg.threshold
      w = min(0.15 + 0.02 * n, gcfg.cont_weight)
      if gcfg.cache == "none" or n < warmup or cache is None:
        a, b = 0, T
        kind = "full" if gcfg.cache == "none" or n < warmup else "refresh"
        kv_in = None
      else:
        if gcfg.cache == "prefix":
          a, b = s, T
        elif vicinity:
          a, b = max(0, s - gcfg.prefix_look), min(T, e + gcfg.after_look)
        else:
          a, b = s, e
        kind, kv_in = "cached", cache  # fresh K/V used for this forward only
      logits, kv = runner.forward(params, cfg, x[a:b], a, emb=emb[a:b] if smoothing else None, cache=kv_in,
                                  logits_range=None if smoothing else (s - a, e - s))
      if kind == "refresh":
        cache = kv
        owed_cached_step = gcfg.dinfer_compat  # dInfer's cached step after a refresh, even with no mask left
      elif kind == "cached":
        owed_cached_step = False
      forwards.append((kind, a, b))
      fblock.append(len(blocks) - 1)
      n += 1
      blk_logits = logits[s - a:e - a] if smoothing else logits
      new, committed, state = runner.decode(dec, state, blk_logits, x[s:e], knobs, mask_id=mask_id, threshold=thr)
      assert getattr(dec, "edits", False) or not (committed & (x[s:e] != mask_id)).any(), \
          "a decoder committed a decoded position"
      before = x[s:e].copy()
      x[s:e] = np.where(committed, new, x[s:e])
      commit[s:e] = np.where(committed, n, commit[s:e])
      writes.append(_writes(before, x[s:e], committed, s, mask_id))
      if smoothing:
        emb = runner.smooth(params, emb, a, b, x[a:b], logits, mask_id, w)
    if np.isin(x[s:e], eos_id).any() and gcfg.early_stop:
      x[e:] = np.atleast_1d(eos_id)[0]
      break
    s += B
  return RefResult(x.tolist(), commit[P:].tolist(), n, forwards, blocks, fblock, writes)


def _extend_cache(kv: KVCache, e: int) -> KVCache:
  """dInfer's extend_cache: the cache covers exactly [0, e); slots not yet written are zeros."""
  have = kv.k.shape[2]
  if have < e:
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, e - have), (0, 0), (0, 0)))  # noqa: E731
    return KVCache(pad(kv.k), pad(kv.v))
  return KVCache(kv.k[:, :, :e], kv.v[:, :, :e])


def _bd_step_forward(runner, params, cfg, x, s: int, e: int, B: int, kv, *, cross: bool, use_cache: bool):
  """One block-diffusion step's forward: (block logits, the cache, its (kind, a, b) record). cross: dInfer v0.2's
  block entry, queries [s - B, e) each seeing the blocks up to its own, both blocks' fresh K/V persisted; else
  the block over the cache (fresh K/V persisted), or without a cache the canvas [0, e) block-causal."""
  if cross:
    m = np.stack([np.arange(e) < ((q // B) + 1) * B for q in range(s - B, e)])
    logits, kv = runner.forward(params, cfg, x[s - B:e], s - B, cache=kv, mask=m, logits_range=(B, B))
    return logits, kv, ("cross", s - B, e)
  if use_cache:
    logits, kv = runner.forward(params, cfg, x[s:e], s, cache=kv, logits_range=(0, B))  # fresh K/V persisted
    return logits, kv, ("cached", s, e)
  logits, _ = runner.forward(params, cfg, x[:e], 0, mask=_block_causal(e, B), logits_range=(s, B))
  return logits, kv, ("full", 0, e)


def _block_diffusion(params, cfg, prompt, gcfg, mask_id, eos_id, runner) -> RefResult:
  assert gcfg.cont_weight == 0
  P, G, B = len(prompt), gcfg.gen_length, gcfg.block_length
  T = math.ceil((P + G) / B) * B
  x = np.array(prompt + [mask_id] * (T - P), np.int64)
  commit = np.full(T, -1, np.int64)
  dec = make_decoder(gcfg, cfg.vocab_size, independent_fixed_steps=runner.independent_fixed_steps)
  knobs = decoders.get(gcfg.decoder).knobs_of(gcfg)
  s0 = (P // B) * B
  n = 0
  forwards, blocks, fblock, writes = [], [], [], []
  use_cache = gcfg.cache != "none"
  settles, edits = getattr(dec, "settles", False), getattr(dec, "edits", False)
  # dInfer v0.2: a block's first forward also rewrites the previous block's K/V from its final tokens, in place
  # of v0.1's clean-up forward after each block (dinfer_compat).
  cross = use_cache and not gcfg.dinfer_compat and not settles

  kv = None
  if use_cache:  # the prompt's blocks in one forward under the block-causal mask
    _, kv = runner.forward(params, cfg, x[:max(s0, B)], 0, mask=_block_causal(max(s0, B), B), logits_range=(0, 1))
    n, forwards, fblock = 1, [("prefill", 0, max(s0, B))], [-1]

  def decode(state, logits, s, e):
    new, committed, state = runner.decode(dec, state, logits, x[s:e], knobs, mask_id=mask_id, threshold=gcfg.threshold)
    assert edits or not (committed & (x[s:e] != mask_id)).any(), "a decoder committed a decoded position"
    before = x[s:e].copy()
    x[s:e] = np.where(committed, new, x[s:e])
    commit[s:e] = np.where(committed, n, commit[s:e])
    writes.append(_writes(before, x[s:e], committed, s, mask_id))
    return state

  s = s0
  while s < T:
    e = s + B
    blocks.append((s, e))
    state = runner.init_state(dec, x[s:e])
    if use_cache:
      kv = _extend_cache(kv, e)
    last_input_had_masks = False
    first = True
    while _block_pending(dec, state, x[s:e], mask_id):
      last_input_had_masks = True
      logits, kv, fwd = _bd_step_forward(runner, params, cfg, x, s, e, B, kv, cross=cross and first and s > s0,
                                         use_cache=use_cache)
      forwards.append(fwd)
      fblock.append(len(blocks) - 1)
      n += 1
      first = False
      state = decode(state, logits, s, e)
    ends_row = np.isin(x[s:e], eos_id).any() and gcfg.early_stop
    # The clean K/V serve the blocks after this one: none after the last block or an EOS that ends the row, nor
    # where the block's last forward already read its final tokens (a decoder that settles its blocks).
    if use_cache and last_input_had_masks and not settles and not cross and (gcfg.dinfer_compat or (e < T and not ends_row)):
      logits, kv = runner.forward(params, cfg, x[s:e], s, cache=kv, logits_range=(0, B))  # clean K/V
      forwards, fblock, n = forwards + [("final", s, e)], fblock + [len(blocks) - 1], n + 1
      state = decode(state, logits, s, e)  # commits nothing: the block has no masks
    if ends_row:
      x[e:] = np.atleast_1d(eos_id)[0]
      break
    s += B
  return RefResult(x.tolist(), commit[P:].tolist(), n, forwards, blocks, fblock, writes)
