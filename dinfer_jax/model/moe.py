"""Mixture of experts: the two routers, two dropless expert kernels and a plain loop reference.

Kernels (chosen by `moe_impl`, "auto" picks per backend and token count, see `choose_impl`):
- "dense": every expert on every token, then weighted by the (mostly zero) routing matrix. E/k times the
  FLOPs, but one batched einsum. At small token counts a MoE forward is bound by reading expert weights
  anyway (a 64-token block at batch 1 touches all 64 experts of LLaDA-MoE), so the wasted FLOPs are free
  up to the roofline's ridge point.
- "ragged": sort the (token, expert) pairs by expert and run a grouped matmul (`jax.lax.ragged_dot`).
  FLOPs are exactly the routed ones; this is the path for many tokens on GPU.
`moe_loop_reference` loops over experts in Python; tests compare both kernels against it.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from dinfer_jax.config import ModelConfig
from dinfer_jax.model.layers import swiglu

# Token count above which "auto" switches from the dense kernel to ragged_dot on accelerators. The dense
# kernel does T*E expert-FLOPs against E expert weights, i.e. about T FLOPs per weight byte in bf16; an
# H200 (790 TFLOP/s, 4.8 TB/s) is bound by weight reads below ~165 FLOPs/byte, so dense is free up to
# about that many tokens. On CPU ragged_dot is far slower than a batched einsum (BENCHMARKS.md: measured
# 30-100x), so CPU always uses dense.
ACCEL_DENSE_MAX_TOKENS = 128


def route(h: jax.Array, lp: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """Routing, in fp32 whatever the weight dtype (a bf16 router flips near-tied top-k choices).

  Args:
    h: [T, D] normed hidden states (T = all tokens of the batch, flattened).
    lp: one layer's params (router [D, E], optional expert_bias [E]).
  Returns:
    weights [T, k] fp32 and expert ids [T, k] int32.
  """
  logits = jnp.einsum("TD,DE->TE", h.astype(jnp.float32), lp["router"].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  k = cfg.n_experts_per_tok
  if cfg.router == "softmax":
    # LLaDA-MoE: softmax over all experts, top-k, and no renormalisation (weights sum to < 1).
    probs = jax.nn.softmax(logits, axis=-1)
    w, idx = jax.lax.top_k(probs, k)
    return w, idx.astype(jnp.int32)
  # LLaDA2: sigmoid scores; the bias only steers selection; selection is limited to the best groups,
  # where a group scores the sum of its top-2 biased scores.
  scores = jax.nn.sigmoid(logits)
  sel = scores + lp["expert_bias"].astype(jnp.float32) if cfg.router_bias else scores
  T, E, G = sel.shape[0], cfg.n_experts, cfg.n_groups
  grouped = sel.reshape(T, G, E // G)
  group_score = jax.lax.top_k(grouped, min(2, E // G))[0].sum(-1)  # [T, G]
  _, keep = jax.lax.top_k(group_score, cfg.topk_groups)  # [T, topk_groups]
  group_mask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep].set(True)
  sel = jnp.where(jnp.repeat(group_mask, E // G, axis=1), sel, -jnp.inf)
  _, idx = jax.lax.top_k(sel, k)
  w = jnp.take_along_axis(scores, idx, axis=-1)
  w = w / (w.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
  return w, idx.astype(jnp.int32)


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("dinfer_jax_target_backend", default=None)


@contextlib.contextmanager
def target_backend(name: str | None):
  """Trace kernel choices for another backend than the one running ("gpu" while compiling deviceless for an
  H200 from a CPU-only process: the roofline bench)."""
  tok = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(tok)


def backend() -> str:
  """The backend kernel choices are made for: target_backend's, else the default backend."""
  return _TARGET.get() or jax.default_backend()


def choose_impl(cfg: ModelConfig, n_tokens: int) -> str:
  if cfg.moe_impl != "auto":
    return cfg.moe_impl
  if backend() == "cpu" or n_tokens <= ACCEL_DENSE_MAX_TOKENS:
    return "dense"
  return "ragged"


def experts_dense(h: jax.Array, w: jax.Array, idx: jax.Array, ex: dict, n_experts: int) -> jax.Array:
  """Every expert on every token; h [T, D] -> [T, D]."""
  dt = h.dtype
  combine = jnp.zeros((h.shape[0], n_experts), jnp.float32).at[jnp.arange(h.shape[0])[:, None], idx].add(w)
  g = jnp.einsum("TD,EDF->TEF", h, ex["gate"].astype(dt))
  u = jnp.einsum("TD,EDF->TEF", h, ex["up"].astype(dt))
  y = jnp.einsum("TEF,EFD->TED", jax.nn.silu(g) * u, ex["down"].astype(dt))
  # The weighted sum over experts in fp32 (MaxText's float32_weight_sum), then back to the activation dtype.
  return jnp.einsum("TED,TE->TD", y.astype(jnp.float32), combine).astype(dt)


def experts_ragged(h: jax.Array, w: jax.Array, idx: jax.Array, ex: dict, n_experts: int) -> jax.Array:
  """Dropless sort-by-expert + grouped matmul; h [T, D] -> [T, D]."""
  T, k = idx.shape
  dt = h.dtype
  flat_e = idx.reshape(-1)  # [T*k]
  order = jnp.argsort(flat_e, stable=True)
  tok = order // k  # the token each sorted row came from
  xs = h[tok]  # [T*k, D]
  sizes = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32)
  g = jax.lax.ragged_dot(xs, ex["gate"].astype(dt), sizes)
  u = jax.lax.ragged_dot(xs, ex["up"].astype(dt), sizes)
  ys = jax.lax.ragged_dot(jax.nn.silu(g) * u, ex["down"].astype(dt), sizes)  # [T*k, D]
  ws = w.reshape(-1)[order]
  out = jnp.zeros((T, h.shape[1]), jnp.float32).at[tok].add(ys.astype(jnp.float32) * ws[:, None])
  return out.astype(dt)


def moe_loop_reference(h: jax.Array, w: jax.Array, idx: jax.Array, ex: dict, n_experts: int) -> jax.Array:
  """Plain reference: a Python loop over experts, each applied to the tokens routed to it (tests only)."""
  out = jnp.zeros(h.shape, jnp.float32)
  for e in range(n_experts):
    we = jnp.where(idx == e, w, 0.0).sum(-1)  # [T] this expert's weight per token (0 if not routed)
    g = h @ ex["gate"][e].astype(h.dtype)
    u = h @ ex["up"][e].astype(h.dtype)
    y = (jax.nn.silu(g) * u) @ ex["down"][e].astype(h.dtype)
    out = out + y.astype(jnp.float32) * we[:, None]
  return out.astype(h.dtype)


EXPERT_KERNELS = {"dense": experts_dense, "ragged": experts_ragged, "loop": moe_loop_reference}


def moe_ffn(h: jax.Array, lp: dict, cfg: ModelConfig, impl: str | None = None) -> jax.Array:
  """The MoE FFN of one layer on normed hidden states h [B, T, D] -> [B, T, D]."""
  B, T, D = h.shape
  flat = h.reshape(B * T, D)
  w, idx = route(flat, lp, cfg)
  impl = impl or choose_impl(cfg, B * T)
  y = EXPERT_KERNELS[impl](flat, w, idx, lp["experts"], cfg.n_experts)
  if "shared" in lp:
    sh = lp["shared"]
    y = y + swiglu(flat, sh["gate"], sh["up"], sh["down"])
  return y.reshape(B, T, D)
