"""Tensor + expert parallel sharding as a rules table from logical axis names to mesh axes.

Mesh axes: "data" (batch rows), "tensor" (attention heads, dense FFN columns; dInfer's TP) and "expert"
(the expert axis of stacked MoE weights; dInfer's EP). Column-parallel kernels shard their output dim on
"tensor", row-parallel ones their input dim; GSPMD inserts the all-reduce after o / down, the role of
dInfer's RowParallelLinear. The router, norms, embedding and LM head are replicated, as in dInfer.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "tensor", "expert")

# logical axis -> mesh axis (or None = replicated). One table; changing the parallelism is editing it.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,
    "vocab": None,
    "embed": None,
    "norm": None,
    "head_dim": None,
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "router_experts": None,
    "act_batch": "data",
    "act_len": None,
    "act_embed": None,
    "cache_len": None,
}

_CURRENT: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("dinfer_jax_mesh", default=None)


def make_mesh(*, data: int = 1, tensor: int = 1, expert: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, tensor, expert) mesh over the first data*tensor*expert devices."""
  devices = list(devices if devices is not None else jax.devices())
  n = data * tensor * expert
  if n > len(devices):
    raise ValueError(f"make_mesh: data*tensor*expert = {n} devices requested, only {len(devices)} available")
  return Mesh(np.array(devices[:n]).reshape(data, tensor, expert), MESH_AXES)


def spec_for(axes: tuple[str | None, ...], mesh: Mesh, shape: tuple[int, ...] | None = None) -> P:
  """PartitionSpec for logical axes. A dim that the mesh axis does not divide stays replicated (e.g. 2 kv
  heads on 4-way tensor parallelism), and each mesh axis is used at most once."""
  out, used = [], set()
  for i, name in enumerate(axes):
    m = LOGICAL_RULES.get(name) if name else None
    if m is None or m in used or mesh.shape[m] == 1 or (shape is not None and shape[i] % mesh.shape[m]):
      out.append(None)
      continue
    used.add(m)
    out.append(m)
  return P(*out)


def param_shardings(abstract_tree: Any, axes_tree: Any, mesh: Mesh) -> Any:
  """NamedSharding tree parallel to the params, from their shapes and logical axes."""
  return jax.tree_util.tree_map(lambda a, ax: NamedSharding(mesh, spec_for(ax, mesh, a.shape)),
                                abstract_tree, axes_tree, is_leaf=lambda x: isinstance(x, tuple))


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None):
  """Activation constraints inside the forward (`shard`) refer to this mesh while tracing."""
  token = _CURRENT.set(mesh)
  try:
    yield mesh
  finally:
    _CURRENT.reset(token)


def current_mesh() -> Mesh | None:
  return _CURRENT.get()


def shard(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Constrain an activation's sharding by logical axes; a no-op without a mesh (CPU tests run the same code)."""
  mesh = _CURRENT.get()
  if mesh is None or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(axes, mesh, x.shape)))
