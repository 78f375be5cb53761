"""The pure forward pass: embed -> the layers (unrolled, or lax.scan over the stack) -> final norm -> fp32 logits.

One function serves every forward the engine needs (docs/design.md, "Model"):
- full forward (no cache): keys are the T inputs; returns their K/V (a cache refresh);
- slice forward: the T inputs sit at canvas positions [cache_start, cache_start + T); their fresh K/V
  replace the cached ones there (where write_mask allows) and attention runs over all S cached keys.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dinfer_jax.cache import KVCache
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import moe as moe_lib
from dinfer_jax.model import quant
from dinfer_jax.model.attention import attention, attention_mask
from dinfer_jax.model.layers import rms_norm, rms_normalize, rope, slice_rows, swiglu, update_rows, write_rows
from dinfer_jax.sharding import current_mesh, shard


class ForwardOut(NamedTuple):
  logits: jax.Array | None  # [B, T', V] fp32 (None with head=False)
  kv: KVCache  # stacked [n_layers, B, S, K, H] or per layer: the K/V attended to (keep_cache: the cache,
  # its window slots rewritten)
  hidden: jax.Array | None = None  # head=False: [B, T', D] the final-normed rows the LM head would take


def _joint_qk(lp: dict) -> bool:
  """Whether queries and keys can be projected, normed and rotated as one [B, T, N + K, H] array: both
  kernels plain or both quantised, and heads not split across devices (joining two head-sharded arrays
  along the heads would move them between devices)."""
  mesh = current_mesh()
  split = mesh is not None and mesh.shape.get("tensor", 1) > 1
  return not split and quant.is_qarray(lp["q"]) == quant.is_qarray(lp["k"])


def _queries_keys(h, lp, cfg: ModelConfig, positions) -> tuple[jax.Array, jax.Array]:
  """Normed (qk_norm) and rotated queries [B, T, N, H] and keys [B, T, K, H] of normed hidden states h.

  Norm and RoPE are per-head work, so running them on queries and keys joined gives the same numbers; on GPU
  it is one norm kernel where two would run (the roofline bench's kernel count), and the joined kernels
  [D, (N + K) H] (quant.join_columns) are one GEMM whose Triton kernel reads the two in place (no copy)."""
  if not _joint_qk(lp):
    q = quant.einsum("BTD,DNH->BTNH", h, lp["q"])
    k = quant.einsum("BTD,DKH->BTKH", h, lp["k"])
    if cfg.qk_norm:
      q = rms_norm(q, lp["q_norm"], cfg.rms_eps)
      k = rms_norm(k, lp["k_norm"], cfg.rms_eps)
    return (rope(q, positions, theta=cfg.rope_theta, rot_dim=cfg.rope_dim),
            rope(k, positions, theta=cfg.rope_theta, rot_dim=cfg.rope_dim))
  _, N, H = lp["q"].shape
  K = lp["k"].shape[1]
  # Joined flat ([D, N H] beside [D, K H]): Triton fuses a concatenation along the GEMM's output columns
  # into its loads, not one along the heads axis.
  qk = quant.einsum("BTD,DX->BTX", h, quant.join_columns([lp["q"], lp["k"]])).reshape(h.shape[:2] + (N + K, H))
  if cfg.qk_norm:
    # Per-head norm with a [H] weight shared by all heads (one for queries, one for keys), before RoPE
    # (not OLMoE's whole-projection norm).
    qk = rms_norm(qk, jnp.concatenate([jnp.broadcast_to(lp["q_norm"], (N, H)),
                                       jnp.broadcast_to(lp["k_norm"], (K, H))]), cfg.rms_eps)
  qk = rope(qk, positions, theta=cfg.rope_theta, rot_dim=cfg.rope_dim)
  return qk[:, :, :N], qk[:, :, N:]


def _layer(x, lp, kv_in, xn=None, *, cfg: ModelConfig, moe: bool, positions, mask, cache_start, write_mask,
           moe_impl, in_place: bool = False, token_valid=None, keys_valid=None):
  """One pre-norm block. x [B, T, D]; kv_in (k, v) [B, S, K, H] or None; xn: rms_normalize(x) when the block
  before computed it (its MoE combine kernel did). in_place: the fresh K/V go into kv_in's buffers (where
  write_mask) and those buffers come back, in the cache dtype. Returns (x, its rms_normalize or None, K/V)."""
  dt = x.dtype
  h = rms_norm(x, lp["attn_norm"], cfg.rms_eps) if xn is None else lp["attn_norm"].astype(dt) * xn
  q, k = _queries_keys(h, lp, cfg, positions)
  v = quant.einsum("BTD,DKH->BTKH", h, lp["v"])
  q = shard(q, ("act_batch", "act_len", "q_heads", "head_dim"))
  if kv_in is None:
    keys, vals = k, v
  else:
    ck, cv = kv_in
    T = x.shape[1]
    if write_mask is not None:
      # Positions outside the write mask keep the cached K/V: the engine runs fixed-width windows and
      # this keeps the attended key set identical to dInfer's variable-width one.
      keys = write_rows(ck, k.astype(ck.dtype), cache_start, write_mask)
      vals = write_rows(cv, v.astype(cv.dtype), cache_start, write_mask)
    else:
      keys = update_rows(ck, k.astype(ck.dtype), cache_start)
      vals = update_rows(cv, v.astype(cv.dtype), cache_start)
  a = attention(q, keys.astype(dt), vals.astype(dt), mask, keys_valid)
  x = x + quant.einsum("BTNH,NHD->BTD", a, lp["o"])
  xn = None
  if moe:
    # The MoE applies the norm's weight itself and adds the residual: on GPU its grouped kernels apply the
    # weight as they load rows and normalise the block's output for the next norm in the combine's kernel.
    x, xn = moe_lib.moe_ffn(rms_normalize(x, cfg.rms_eps), lp, cfg, moe_impl, norm_w=lp["ffn_norm"], residual=x,
                            positions=positions, valid=token_valid)
  else:
    h = rms_norm(x, lp["ffn_norm"], cfg.rms_eps)
    x = x + swiglu(h, lp["mlp"]["gate"], lp["mlp"]["up"], lp["mlp"]["down"])
  x = shard(x, ("act_batch", "act_len", "act_embed"))
  # In place: the cache's own buffers go back as it holds them; otherwise the K/V attended to, in the
  # activation dtype.
  return x, xn, (keys, vals) if in_place else (keys.astype(dt), vals.astype(dt))


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array | None = None, *,
            positions: jax.Array | None = None, embeds: jax.Array | None = None,
            mask: jax.Array | None = None, cache: KVCache | None = None,
            cache_start: jax.Array | int | None = None, write_mask: jax.Array | None = None,
            logits_start: jax.Array | int = 0, logits_len: int | None = None,
            moe_impl: str | None = None, unroll_layers: bool = True, remat: bool = False,
            kv_layers: bool = False, keep_cache: bool = False, head: bool = True) -> ForwardOut:
  """Pure forward.

  Args:
    params: the param tree (model/params.py), stacked or with per-layer lists (params.unstack_layers).
    tokens: [B, T] int token ids, or None when `embeds` [B, T, D] is given (iteration smoothing).
    positions: [B, T] absolute RoPE positions (default arange(T) per row).
    mask: None (full bidirectional), [B, S] key validity or [B, T, S] per-query mask; True = may attend.
    cache: KVCache to attend to (stacked [n_layers, B, S, K, H] or per layer); None for a full forward
      (then S = T).
    cache_start: canvas index of the first input position in the cache (scalar, may be traced; or [B], one
      per row, for continuous batching).
    write_mask: [B, T] bool; inputs whose fresh K/V replace the cached ones (default: all).
    logits_start, logits_len: compute logits only for inputs [start, start + len) (the LM head is the
      largest matmul at V=157k; the engine only needs the block's logits).
    moe_impl: override cfg.moe_impl for this call ("dense", "ragged", "grouped", "loop").
    unroll_layers: one traced block per layer (inference: weights read in place) or a lax.scan over the
      stacked layers (one traced block: faster compiles, e.g. for training).
    remat: gradient checkpointing (training): each layer keeps only its input for the backward pass and
      recomputes its activations there, so activation memory is one layer's, not n_layers', for about a
      third more FLOPs per step.
    kv_layers: return the K/V per layer (tuples of [B, S, K, H], the engine's cache layout); default
      stacked. A per-layer `cache` implies it.
    keep_cache: with a per-layer `cache`: each layer writes its fresh K/V into the cache's own buffer in
      place (where write_mask) and the returned kv is that cache, so no [B, S, K, H] buffer is copied (a
      slice-and-update of a cache that stays live copies it whole: 0.34 GB of a 7B-A1B batch-1 cached
      forward, 2.7 GB at batch 8). The caller must use the returned kv in place of the input (donate the
      input, or carry it in a loop). The written slots are not put back: the engine's cached forwards
      rewrite the same slots before every read until the next refresh rewrites them all (engine.loop).
    head: False stops before the LM head and returns the final-normed rows (ForwardOut.hidden) for the
      caller to take fewer of them through lm_head (the engine's refresh under smoothing: only the rows
      from the block on, whose count changes with the block).
  Returns:
    ForwardOut(logits [B, T', V] fp32, kv of every layer: what the forward attended to, or with
    keep_cache the cache it was given).
  """
  if embeds is None:
    if tokens is None:
      raise ValueError("forward: pass token ids or input embeddings")
    x = quant.take_rows(params["embed"], tokens)
  else:
    x = embeds
  dt = params["embed"].dtype
  x = x.astype(dt)
  B, T = x.shape[:2]
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  if cache is not None and cache_start is None:
    raise ValueError("forward: a cache needs cache_start")
  per_layer = kv_layers or (cache is not None and cache.per_layer)
  if keep_cache and (cache is None or not cache.per_layer):
    raise ValueError("forward: keep_cache needs a per-layer cache (KVCache.zeros(..., per_layer=True))")
  amask = attention_mask(mask, T)
  keys_valid = mask if mask is not None and mask.ndim == 2 else None  # one mask per key: attention's kernel choice
  x = shard(x, ("act_batch", "act_len", "act_embed"))
  # Block routing (LLaDA2.2) groups real tokens by aligned positions: which inputs are real, from the mask.
  token_valid = _query_valid(mask, B, T, cache_start) if cfg.router == "sigmoid_block" else None

  ks, vs = [], []
  xn = None  # rms_normalize(x), when the last block's MoE kernel computed it
  start = 0
  for name, n, is_moe in (("dense_layers", cfg.n_dense_layers, False), ("moe_layers", cfg.n_moe_layers, True)):
    if n == 0:
      continue
    kv_in = None if cache is None else (cache.k[start:start + n], cache.v[start:start + n])
    body = functools.partial(_layer, cfg=cfg, moe=is_moe, positions=positions, mask=amask, keys_valid=keys_valid,
                             cache_start=cache_start, write_mask=write_mask, moe_impl=moe_impl,
                             in_place=keep_cache, token_valid=token_valid)
    if remat:
      body = jax.checkpoint(body)
    if isinstance(params[name], (list, tuple)):
      # Per-layer buffers (params.unstack_layers): every kernel, cuBLAS and Triton custom calls included,
      # reads the layer's weights in place.
      for i, lp in enumerate(params[name]):
        x, xn, (k, v) = body(x, lp, None if kv_in is None else (kv_in[0][i], kv_in[1][i]), xn)
        ks.append(k if per_layer else k[None])
        vs.append(v if per_layer else v[None])
    elif unroll_layers:
      # Static per-layer slices of the stacked weights: the GEMMs read them in place. Under lax.scan the
      # GPU compile copies every layer's expert weights out of the stack first (the roofline bench: 27 of
      # the 50 GB of a 7B-A1B cached forward were those copies).
      for i in range(n):
        lp = jax.tree_util.tree_map(lambda a: a[i], params[name])
        x, xn, (k, v) = body(x, lp, None if kv_in is None else (kv_in[0][i], kv_in[1][i]), xn)
        ks.append(k if per_layer else k[None])
        vs.append(v if per_layer else v[None])
    else:
      if per_layer:
        raise ValueError("forward: per-layer K/V need the unrolled layers (unroll_layers=True)")
      # The scan's carry is x alone: a block's normalised output (xn) is recomputed by the next block.
      if kv_in is None:
        x, (k, v) = jax.lax.scan(lambda c, lp: body(c, lp, None)[::2], x, params[name])
      else:
        x, (k, v) = jax.lax.scan(lambda c, xs: body(c, xs[0], xs[1])[::2], x, (params[name], kv_in))
      xn = None
      ks.append(k)
      vs.append(v)
    start += n
  if per_layer:
    kv = KVCache(k=tuple(ks), v=tuple(vs))
  else:
    kv = KVCache(k=jnp.concatenate(ks) if len(ks) > 1 else ks[0], v=jnp.concatenate(vs) if len(vs) > 1 else vs[0])

  x = rms_norm(x, params["final_norm"], cfg.rms_eps) if xn is None else params["final_norm"].astype(dt) * xn
  if logits_len is not None:
    x = slice_rows(x, logits_start, logits_len)
  if not head:
    return ForwardOut(logits=None, kv=kv, hidden=x)
  return ForwardOut(logits=lm_head(params, x), kv=kv)


def _query_valid(mask: jax.Array | None, B: int, T: int, cache_start) -> jax.Array | None:
  """[B, T] which inputs are real tokens: a per-query mask lets a real token attend to itself; a key-validity
  mask over the canvas holds the inputs at cache_start (0 without a cache)."""
  if mask is None:
    return None
  start = 0 if cache_start is None else cache_start
  if mask.ndim == 3:
    own = mask if mask.shape[2] == T else slice_rows(mask, start, T, axis=2)
    return jnp.diagonal(own, axis1=1, axis2=2)
  return mask if mask.shape[1] == T else slice_rows(mask, start, T)


def lm_head(params: dict, x: jax.Array) -> jax.Array:
  """[B, T, D] final-normed rows -> [B, T, V] logits, in fp32: decoding confidences and thresholds are
  computed from them."""
  logits = quant.einsum("BTD,DV->BTV", x, params["lm_head"], preferred_element_type=jnp.float32)
  return shard(logits, ("act_batch", "act_len", "vocab"))
