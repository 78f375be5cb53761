"""The parameter tree: shapes, logical axis names and random initialisation, all derived from ModelConfig.

Layout (kernels are [in, out]; layers stacked on a leading axis so the forward can lax.scan):

  embed        [V, D]                       lm_head [D, V]        final_norm [D]
  dense_layers (n_dense_layers stacked)     moe_layers (n_moe_layers stacked)
    attn_norm [L, D]  q [L, D, N, H]  k,v [L, D, K, H]  o [L, N, H, D]  q_norm,k_norm [L, H] (qk_norm)
    ffn_norm [L, D]
    dense:  mlp.{gate,up} [L, D, F]   mlp.down [L, F, D]
    moe:    router [L, D, E]  expert_bias [L, E] (router_bias)
            experts.{gate,up} [L, E, D, F]   experts.down [L, E, F, D]
            shared.{gate,up} [L, D, Fs]   shared.down [L, Fs, D] (shared_expert_ffn_dim > 0)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import sharding
from dinfer_jax.config import ModelConfig

# Parameters that stay fp32 whatever the weight dtype: the router's selection-only bias is a buffer
# that dInfer keeps in fp32, and rounding it would change which experts are picked.
FP32_PARAMS = ("expert_bias",)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  axes: tuple[str, ...]  # logical axis names, one per dim (see sharding.py)
  init: str = "normal"  # "normal" (fan-in scaled) or "ones" (norm weights) or "zeros"

  def __post_init__(self):
    if len(self.shape) != len(self.axes):
      raise ValueError(f"ParamSpec: shape {self.shape} and axes {self.axes} differ in rank")


def _layer_specs(cfg: ModelConfig, n: int, moe: bool) -> dict[str, Any]:
  D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  s = {
      "attn_norm": ParamSpec((n, D), ("layers", "norm"), "ones"),
      "q": ParamSpec((n, D, N, H), ("layers", "embed", "q_heads", "head_dim")),
      "k": ParamSpec((n, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
      "v": ParamSpec((n, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
      "o": ParamSpec((n, N, H, D), ("layers", "q_heads", "head_dim", "embed")),
      "ffn_norm": ParamSpec((n, D), ("layers", "norm"), "ones"),
  }
  if cfg.qk_norm:
    s["q_norm"] = ParamSpec((n, H), ("layers", "head_dim"), "ones")
    s["k_norm"] = ParamSpec((n, H), ("layers", "head_dim"), "ones")
  if not moe:
    F = cfg.ffn_dim
    s["mlp"] = {
        "gate": ParamSpec((n, D, F), ("layers", "embed", "mlp")),
        "up": ParamSpec((n, D, F), ("layers", "embed", "mlp")),
        "down": ParamSpec((n, F, D), ("layers", "mlp", "embed")),
    }
    return s
  E, F = cfg.n_experts, cfg.expert_ffn_dim
  s["router"] = ParamSpec((n, D, E), ("layers", "embed", "router_experts"))
  if cfg.router_bias:
    s["expert_bias"] = ParamSpec((n, E), ("layers", "router_experts"), "zeros")
  s["experts"] = {
      "gate": ParamSpec((n, E, D, F), ("layers", "experts", "embed", "expert_mlp")),
      "up": ParamSpec((n, E, D, F), ("layers", "experts", "embed", "expert_mlp")),
      "down": ParamSpec((n, E, F, D), ("layers", "experts", "expert_mlp", "embed")),
  }
  if cfg.shared_expert_ffn_dim:
    Fs = cfg.shared_expert_ffn_dim
    s["shared"] = {
        "gate": ParamSpec((n, D, Fs), ("layers", "embed", "mlp")),
        "up": ParamSpec((n, D, Fs), ("layers", "embed", "mlp")),
        "down": ParamSpec((n, Fs, D), ("layers", "mlp", "embed")),
    }
  return s


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  """Nested dict of ParamSpec with the structure of the params pytree."""
  D, V = cfg.d_model, cfg.vocab_size
  specs: dict[str, Any] = {
      "embed": ParamSpec((V, D), ("vocab", "embed")),
      "final_norm": ParamSpec((D,), ("norm",), "ones"),
      "lm_head": ParamSpec((D, V), ("embed", "vocab")),
  }
  if cfg.n_dense_layers:
    specs["dense_layers"] = _layer_specs(cfg, cfg.n_dense_layers, moe=False)
  if cfg.n_moe_layers:
    specs["moe_layers"] = _layer_specs(cfg, cfg.n_moe_layers, moe=True)
  return specs


def _is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def leaf_dtype(path: tuple[str, ...], dtype) -> jnp.dtype:
  return jnp.dtype(jnp.float32) if path[-1] in FP32_PARAMS else jnp.dtype(dtype)


def _keys(path) -> tuple[str, ...]:
  return tuple(p.key for p in path)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict[str, Any]:
  """ShapeDtypeStruct tree: the params without materialising anything."""
  return jax.tree_util.tree_map_with_path(
      lambda p, s: jax.ShapeDtypeStruct(s.shape, leaf_dtype(_keys(p), dtype)), param_specs(cfg), is_leaf=_is_spec)


def logical_axes(cfg: ModelConfig) -> dict[str, Any]:
  """Tree of logical axis-name tuples, parallel to the params (for sharding rules)."""
  return jax.tree_util.tree_map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """Total parameters, and those touched per token (top-k experts instead of all)."""
  tree = abstract_params(cfg)
  total = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))
  experts = tree.get("moe_layers", {}).get("experts", {})
  expert_total = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(experts))
  active = total - expert_total
  if cfg.n_moe_layers:
    active += expert_total * cfg.n_experts_per_tok // cfg.n_experts
  # The embedding table is a lookup, not a matmul: exclude it from the active count, as the papers do.
  active -= cfg.vocab_size * cfg.d_model
  return {"total": total, "active": active}


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict[str, Any]:
  """Random params (fan-in scaled normals, unit norms) for tests and training from scratch."""
  specs = param_specs(cfg)
  flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
  keys = jax.random.split(key, len(flat))
  out = []
  for (path, spec), k in zip(flat, keys):
    dt = leaf_dtype(_keys(path), dtype)
    if spec.init == "ones":
      out.append(jnp.ones(spec.shape, dt))
    elif spec.init == "zeros":
      out.append(jnp.zeros(spec.shape, dt))
    else:
      fan_in = _fan_in(_keys(path), spec, cfg)
      out.append((jax.random.normal(k, spec.shape, jnp.float32) / np.sqrt(fan_in)).astype(dt))
  return jax.tree_util.tree_unflatten(treedef, out)


def _fan_in(path, spec: ParamSpec, cfg: ModelConfig) -> int:
  name = path[-1]
  if name == "embed":
    return 1
  if name == "o":
    return cfg.n_heads * cfg.head_dim
  if name in ("q", "k", "v", "router", "lm_head", "gate", "up"):
    return cfg.d_model
  if name == "down":
    return spec.shape[-2]
  return spec.shape[-1]


LAYER_GROUPS = ("dense_layers", "moe_layers")


def unstack_layers(params: dict[str, Any], take=None) -> dict[str, Any]:
  """The inference layout: each stacked layer group becomes a list of per-layer trees (separate buffers).

  On GPU, library kernels (cuBLAS GEMMs, tokamax's Triton grouped GEMM) take whole buffers: fed a slice of
  the [layers, ...] stack, XLA copies the layer's weights out first (roofline bench). The leaves keep their
  per-layer logical axes (the spec's axes without "layers"). take(leaf, i) slices a leaf (default leaf[i];
  the roofline bench passes one for ShapeDtypeStructs). Already-unstacked groups are returned as they are.
  """
  take = take or (lambda a, i: a[i])
  out = dict(params)
  for name in LAYER_GROUPS:
    group = params.get(name)
    if isinstance(group, dict):
      n = jax.tree_util.tree_leaves(group)[0].shape[0]
      out[name] = [jax.tree_util.tree_map(lambda a: take(a, i), group) for i in range(n)]
  return out


def is_unstacked(params: dict[str, Any]) -> bool:
  return any(isinstance(params.get(name), (list, tuple)) for name in LAYER_GROUPS)


def stack_layers(params: dict[str, Any]) -> dict[str, Any]:
  """unstack_layers' inverse: each per-layer list back into one [layers, ...] tree (the checkpoint and
  training layout). Already-stacked groups are returned as they are."""
  out = dict(params)
  for name in LAYER_GROUPS:
    group = params.get(name)
    if isinstance(group, (list, tuple)):
      out[name] = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *group)
  return out


def unstacked_logical_axes(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
  """logical_axes for the per-layer layout of `params`: each layer's leaves keep their axes minus "layers"."""
  axes = logical_axes(cfg)
  is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
  for name in LAYER_GROUPS:
    if name in axes and isinstance(params.get(name), (list, tuple)):
      per_layer = jax.tree_util.tree_map(lambda ax: ax[1:], axes[name], is_leaf=is_axes)
      axes[name] = [per_layer] * len(params[name])
  return axes


def engine_layout(params: dict[str, Any], cfg: ModelConfig, mesh=None) -> dict[str, Any]:
  """The layout the engine's programs run on, made once when a model is loaded: per-layer buffers
  (unstack_layers), each placed on its sharding when there is a mesh. Leaf by leaf, each stacked leaf dropped
  once sliced, so the model never exists twice (only one leaf's layers do, for a moment)."""
  out = dict(params)
  for name in LAYER_GROUPS:
    group = out.pop(name, None)
    if not isinstance(group, dict):
      if group is not None:
        out[name] = group
      continue
    leaves, treedef = jax.tree_util.tree_flatten(group)
    del group
    n = leaves[0].shape[0]
    per_leaf = []
    while leaves:
      a = leaves.pop(0)
      per_leaf.append([a[i] for i in range(n)])
      del a
    out[name] = [jax.tree_util.tree_unflatten(treedef, [layers[i] for layers in per_leaf]) for i in range(n)]
  if mesh is not None:
    out = jax.device_put(out, sharding.param_shardings(out, unstacked_logical_axes(cfg, out), mesh))
  return out


# Jitted so the test fuses into the reduction: no bool (or fp32) copy of a multi-GiB expert stack.
# fp32 count: an int32 one could overflow on a leaf of more than 2**31 values (exact up to 2**24).
_count_nonfinite = jax.jit(lambda x: jnp.sum(~jnp.isfinite(x), dtype=jnp.float32))


def nonfinite_weights(params) -> list[tuple[str, int]]:
  """(dotted leaf path, number of NaN/inf values) of every floating param leaf that has any (8-bit leaves:
  their values and scales)."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    n = int(_count_nonfinite(x))
    if n:
      out.append((".".join(str(getattr(k, "key", k)) for k in path), n))
  return out


def nonfinite_names(bad: list[tuple[str, int]]) -> str:
  """nonfinite_weights' findings named: the first three leaves with their counts, then how many more."""
  more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
  return ", ".join(f"{p} ({n} values)" for p, n in bad[:3]) + more


def describe_nonfinite(bad: list[tuple[str, int]]) -> str:
  """The one-line refusal for nonfinite_weights' findings."""
  return f"has NaN/inf weights in {nonfinite_names(bad)}: its logits would be NaN; the checkpoint is broken"
