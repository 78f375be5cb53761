"""Tensor + expert parallel sharding as a rules table from logical axis names to mesh axes.

Mesh axes: "data" (batch rows), "tensor" (attention heads, dense FFN columns; dInfer's TP) and "expert"
(the expert axis of stacked MoE weights; dInfer's EP). Column-parallel kernels shard their output dim on
"tensor", row-parallel ones their input dim; GSPMD inserts the all-reduce after o / down, the role of
dInfer's RowParallelLinear. The router and norms are replicated. The embedding table and LM head are split
by vocabulary on "tensor" (as vLLM's VocabParallelEmbedding / ParallelLMHead; dInfer replicates them): each
device reads 1/T of the 2 x 157k x 2048 table per forward, and GSPMD reduces the logits' softmax, argmax and
the embedding rows across the split. On 8 H200s (tensor=8, 7B-A1B, batch 1, deviceless) that takes the
weights per GPU from 2.79 to 1.74 GiB and the cached forward from 2.11 to 1.96 ms realistic, for one more
all-reduce of 0.2 MiB (bench.mesh_compile).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dinfer_jax.model import quant

MESH_AXES = ("data", "tensor", "expert")

# logical axis -> mesh axis (or None = replicated). One table; changing the parallelism is editing it.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,
    "vocab": "tensor",  # vocab-parallel embedding and LM head (module docstring)
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

# Logical axes of the generation state (the engine constrains its loop carry with these, so the KV cache
# and the canvas stay split by batch rows on "data" and the cache's kv heads on "tensor" for the whole loop).
CANVAS_AXES = ("act_batch", "act_len")  # canvas, valid, positions, commit steps
EMBED_AXES = ("act_batch", "act_len", "act_embed")  # the soft-embedding canvas of iteration smoothing
CACHE_AXES = ("layers", "act_batch", "cache_len", "kv_heads", "head_dim")  # KVCache.k / .v
ROW_AXES = ("act_batch",)  # per-row counters, and the leading axis of every decoder-state leaf

_CURRENT: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("dinfer_jax_mesh", default=None)


def make_mesh(*, data: int = 1, tensor: int = 1, expert: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, tensor, expert) mesh over the first data*tensor*expert devices.

  Devices are ordered by (process, id), so with several processes (one per host) tensor and expert groups
  stay inside a host (fast links) and the data axis is what crosses hosts. A whole TPU slice is laid out by
  its chips' coordinates instead (its links join hosts too)."""
  for name, n in (("data", data), ("tensor", tensor), ("expert", expert)):
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"make_mesh: {name}={n!r} must be a positive int")
  devices = list(devices if devices is not None else jax.devices())
  devices.sort(key=lambda d: (d.process_index, d.id))
  n = data * tensor * expert
  if n > len(devices):
    raise ValueError(f"make_mesh: data*tensor*expert = {n} devices requested, only {len(devices)} available")
  if n == len(devices) and devices[0].platform == "tpu":
    # A whole TPU slice, on one host or several: its chips are laid out by their torus coordinates, so each
    # tensor or expert group is a ring of ICI neighbours (id order can put a group's chips hops apart). ICI
    # joins every chip of a slice, hosts included, so groups may cross hosts.
    return Mesh(mesh_utils.create_device_mesh((data, tensor, expert), devices, allow_split_physical_axes=True),
                MESH_AXES)
  return Mesh(np.array(devices[:n]).reshape(data, tensor, expert), MESH_AXES)


# ----------------------------------------------------------------------------- command lines
def add_parallel_flags(ap) -> None:
  """--mesh and the multi-process flags (one process per host, jax.distributed) of a command line."""
  g = ap.add_argument_group("parallelism (sharding.make_mesh; several processes with jax.distributed)")
  g.add_argument("--mesh", default=None, metavar="data=D,tensor=T,expert=E",
                 help="device mesh; default: none on one process, data=<all devices> on several")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT|auto",
                 help="jax.distributed coordinator (process 0's address); enables multi-process. 'auto': the "
                      "cluster tells jax.distributed (every host of a Cloud TPU slice, SLURM, Open MPI)")
  g.add_argument("--num-processes", type=int, default=None)
  g.add_argument("--process-id", type=int, default=None)


def parse_mesh(spec: str) -> dict[str, int]:
  """'data=2,tensor=4' -> {'data': 2, 'tensor': 4}."""
  out = {}
  for item in spec.split(","):
    name, _, val = item.partition("=")
    name = name.strip()
    if name not in MESH_AXES or not val.strip().isdigit() or int(val) < 1:
      raise ValueError(f"--mesh: bad item {item!r}; expected comma-separated {'/'.join(MESH_AXES)}=<positive int>")
    out[name] = int(val)
  return out


def setup_parallel(args) -> Mesh | None:
  """Starts jax.distributed when --coordinator is given and returns the mesh the flags ask for."""
  if args.coordinator == "auto":
    if args.num_processes is not None or args.process_id is not None:
      raise ValueError("--coordinator auto takes the process count and id from the cluster; drop "
                       "--num-processes/--process-id (or name the coordinator's HOST:PORT)")
    # The same command on every host: jax.distributed reads the peers from the cluster (a TPU VM's
    # metadata, SLURM's or Open MPI's environment).
    jax.distributed.initialize()
  elif args.coordinator is not None:
    if args.num_processes is None or args.process_id is None:
      raise ValueError("--coordinator needs --num-processes and --process-id")
    if not 0 <= args.process_id < args.num_processes:
      raise ValueError(f"--process-id {args.process_id} is outside [0, --num-processes={args.num_processes})")
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
  elif args.num_processes is not None or args.process_id is not None:
    raise ValueError("--num-processes/--process-id need --coordinator")
  if args.mesh:
    return make_mesh(**parse_mesh(args.mesh))
  if jax.process_count() > 1:
    return make_mesh(data=jax.device_count())
  return None


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
  """NamedSharding tree parallel to the params, from their shapes and logical axes. An 8-bit weight (a qwix
  QArray, model/quant.py) gets a QArray of shardings: its values split like the weight, its scales along the
  same axes where they have more than one entry (replicated where a mesh axis does not divide them)."""

  def one(a, ax):
    if quant.is_qarray(a):
      scale_ax = tuple(name if n > 1 else None for name, n in zip(ax, a.scale.shape))
      return quant.with_parts(a, NamedSharding(mesh, spec_for(ax, mesh, a.qvalue.shape)),
                              NamedSharding(mesh, spec_for(scale_ax, mesh, a.scale.shape)))
    return NamedSharding(mesh, spec_for(ax, mesh, a.shape))

  return jax.tree_util.tree_map(one, abstract_tree, axes_tree,
                                is_leaf=lambda x: isinstance(x, tuple) or quant.is_qarray(x))


def data_size(mesh: Mesh | None) -> int:
  """How many ways the batch rows are split (1 without a mesh)."""
  return 1 if mesh is None else mesh.shape["data"]


def named(mesh: Mesh, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
  """The NamedSharding of an array of this shape with these logical axes."""
  return NamedSharding(mesh, spec_for(axes, mesh, shape))


def row_sharded(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Batch rows (axis 0) on "data", everything else replicated."""
  return named(mesh, ROW_AXES + (None,) * (len(shape) - 1), shape)


def put_global(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A host array that every process holds in full -> a global jax.Array with this sharding; each process
  only copies the shards of its own devices (so it also works when the mesh spans several processes)."""
  host = np.asarray(host)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_host(x: jax.Array) -> np.ndarray:
  """The full value of a (possibly multi-process) global array on every process."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None):
  """Activation constraints inside the forward (`shard`) refer to this mesh while tracing. jax.set_mesh is
  entered too so the mesh is part of jit's trace-cache key: a program traced under one mesh is never reused
  under another."""
  token = _CURRENT.set(mesh)
  try:
    if mesh is None:
      yield mesh
    else:
      with jax.set_mesh(mesh):
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


def shard_rows(tree: Any) -> Any:
  """Constrains every array leaf of a pytree to batch rows (its leading axis) on "data"."""
  return jax.tree_util.tree_map(lambda x: shard(x, ROW_AXES + (None,) * (x.ndim - 1)) if x.ndim else x, tree)
