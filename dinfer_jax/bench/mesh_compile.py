"""Deviceless compile of a sharded forward for a mesh of H200s or TPUs: per-device memory, bytes, FLOPs,
collectives, TPS.

  JAX_PLATFORMS=cpu python -m dinfer_jax.bench.mesh_compile [--layouts tensor=8 tensor=4,expert=2 expert=8]
      [--batches 1 32] [--chip h200|v6e|v5e|v5p] [--json out.json]

Needs the CUDA plugin next to CPU jax (`pip install "jax[cuda12]"`) for the H200, libtpu (`pip install -e
".[tpu]"`) for a TPU, no device: XLA compiles for described chips (jax.experimental.topologies) and the
optimised per-device module is analysed on the CPU client. The weights are abstract (ShapeDtypeStruct with the
rules table's shardings), so nothing is allocated.

For each mesh layout and batch it compiles the two forwards generation runs (LLaDA-MoE-7B-A1B, bf16,
prompt 256 + gen 1024 = 1280-position canvas, block 64, dual cache): the cached window forward (64
inputs over the 1280-key cache, logits of the block) and the block-entry refresh (the whole canvas,
its K/V out). Reported per device: memory (arguments = weight shard + cache shard; temporaries), FLOPs and
bytes of one forward (layer scans unrolled for the measurement, since XLA's cost analysis counts a loop
body once), and every collective XLA inserted (count and bytes). Predicted time per forward:
  max(bytes / HBM bandwidth, FLOPs / peak) + sum over collectives of (ring factor * bytes / link + latency)
and TPS at dInfer's measured TPF: a block of 64 takes one refresh and (64 / TPF - 1) cached forwards.
The realistic figure charges each kernel of the per-device module as bench.realistic does (its class's share
of the achievable rates, per-kernel floors; on a TPU the assumed fractions of realistic.charges_for_tpu)
plus the collectives. These are predictions from the compiled program, not timings.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
from jax._src.lib import _jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from dinfer_jax import cli_help
from dinfer_jax import hardware, sharding
from dinfer_jax.bench import realistic
from dinfer_jax.bench import roofline
from dinfer_jax.cache import KVCache
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import params as params_lib
from dinfer_jax.model.transformer import forward

NVLINK_BW = hardware.CHIPS["h200"].nvlink_bytes_per_s  # bytes/s per direction per GPU (NVLink 4: 900 GB/s both)
COLLECTIVE_LATENCY = 1e-6 * realistic.COLLECTIVE_US  # s per collective launch + sync

# dInfer's LLaDA-MoE setting behind 681 TPS (8xH800, TP=8, batch 1): threshold 0.8 + smoothing + vicinity,
# dual cache, average TPF 3.87 over six benchmarks (paper Table 1).
DINFER_TPS, DINFER_TPF = 681.0, 3.87
PROMPT, GEN, BLOCK = 256, 1024, 64




def topology_mesh(layout: dict[str, int], chip: str = "h200"):
  """A (data, tensor, expert) mesh over described chips (no devices needed): H200s, or a TPU slice."""
  if chip in hardware.TPUS:
    return roofline.tpu_mesh(chip, layout)
  n = math.prod(layout.values())
  topo = topologies.get_topology_desc(platform="cuda", target_config=roofline.target_config(hardware.CHIPS[chip]),
                                      topology=f"1x1x{n}")
  shape = tuple(layout.get(a, 1) for a in sharding.MESH_AXES)
  return topologies.make_mesh(topo, shape, sharding.MESH_AXES)


@contextlib.contextmanager
def unrolled_scans():
  """Traces lax.scan fully unrolled: XLA's cost analysis counts a while-loop body once, so per-forward
  totals need the layers laid out (measurement only; the engine keeps its scan)."""
  orig = jax.lax.scan
  jax.lax.scan = functools.partial(orig, unroll=True)
  try:
    yield
  finally:
    jax.lax.scan = orig


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Count and result bytes of each collective kind in an optimised HLO module (async pairs once)."""
  out: dict[str, dict[str, int]] = {}
  for comp in realistic.Module(hlo_text).comps.values():
    for _, result, op, _ in comp:
      if (kind := realistic.collective_kind(op)) is None:
        continue
      e = out.setdefault(kind, {"count": 0, "bytes": 0})
      e["count"] += 1
      e["bytes"] += realistic.nbytes(realistic.collective_result(result, op))
  return out


def collective_seconds(colls: dict[str, dict[str, int]], n_devices: int, link: float = NVLINK_BW) -> float:
  """Ring-algorithm estimate over all n_devices (realistic.ring_link_bytes) at `link` bytes/s, plus a fixed
  latency per collective."""
  return sum(realistic.ring_link_bytes(kind, e["bytes"], n_devices) / link + e["count"] * COLLECTIVE_LATENCY
             for kind, e in colls.items())


def _abstract(shape, dtype, mesh, axes):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, sharding.spec_for(axes, mesh, shape)))


def compile_forward(cfg: ModelConfig, mesh, batch: int, kind: str, moe_impl: str = "dense"):
  """Lowers and compiles one forward for the described devices; returns the compiled executable."""
  Tc = PROMPT + GEN
  # The engine's layout: per-layer weight buffers placed by the rules table (params.engine_layout).
  params = params_lib.unstack_layers(params_lib.abstract_params(cfg, jnp.bfloat16),
                                     take=lambda a, i: jax.ShapeDtypeStruct(a.shape[1:], a.dtype))
  p_sh = sharding.param_shardings(params, params_lib.unstacked_logical_axes(cfg, params), mesh)
  params = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, p_sh)
  rows = lambda shape, dt: _abstract(shape, dt, mesh, sharding.ROW_AXES + (None,) * (len(shape) - 1))  # noqa: E731
  cache_shape = (cfg.n_layers, batch, Tc, cfg.n_kv_heads, cfg.head_dim)
  cache = KVCache(k=_abstract(cache_shape, jnp.bfloat16, mesh, sharding.CACHE_AXES),
                  v=_abstract(cache_shape, jnp.bfloat16, mesh, sharding.CACHE_AXES))
  repl_i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
  if kind == "cached":
    def fn(params, tokens, positions, valid, cache, start):
      out = forward(params, cfg, tokens, positions=positions, mask=valid, cache=cache, cache_start=start,
                    logits_start=0, logits_len=BLOCK, moe_impl=moe_impl)
      return out.logits, out.kv
    args = (params, rows((batch, BLOCK), jnp.int32), rows((batch, BLOCK), jnp.int32), rows((batch, Tc), bool),
            cache, repl_i32)
    donate = (4,)  # the cache is updated in place, as in the engine's loop
  else:
    def fn(params, tokens, positions, valid, start):
      out = forward(params, cfg, tokens, positions=positions, mask=valid, logits_start=start,
                    logits_len=BLOCK, moe_impl=moe_impl)
      return out.logits, out.kv
    args = (params, rows((batch, Tc), jnp.int32), rows((batch, Tc), jnp.int32), rows((batch, Tc), bool), repl_i32)
    donate = ()
  with sharding.use_mesh(mesh), unrolled_scans():
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def analyse(compiled, n_devices: int, chip: str = "h200") -> dict:
  module = compiled.runtime_executable().hlo_modules()[0]
  cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  colls = collectives(text)
  flops, nbytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  spec = hardware.TPUS.get(chip) or hardware.CHIPS[chip]
  t_compute = max(nbytes / spec.hbm_bytes_per_s, flops / spec.bf16_flops)
  t_coll = collective_seconds(colls, n_devices, realistic.link_bytes_per_s(chip))
  # The realistic figure charges each collective in the module (its replica group's size, ring model).
  real = realistic.forward_time({"flops": flops, "bytes": nbytes}, realistic.Module(text),
                                  realistic.with_links(realistic.CHARGES[chip], chip))
  return {"flops": flops, "bytes": nbytes, "arg_bytes": int(mem.argument_size_in_bytes),
          "temp_bytes": int(mem.temp_size_in_bytes), "out_bytes": int(mem.output_size_in_bytes),
          "alias_bytes": int(mem.alias_size_in_bytes), "collectives": colls,
          "t_roofline_s": t_compute, "t_collectives_s": t_coll, "t_forward_s": t_compute + t_coll,
          "t_realistic_s": real["realistic_s"], "realistic_bytes": real["realistic_bytes"],
          "kernels": real["kernels"]}


def predicted_tps(t_refresh: float, t_cached: float, batch: int, tpf: float = DINFER_TPF) -> tuple[float, float]:
  """(per-sequence TPS, aggregate TPS): a 64-token block = one refresh + (64/TPF - 1) cached forwards."""
  t_block = t_refresh + (BLOCK / tpf - 1) * t_cached
  per_seq = BLOCK / t_block
  return per_seq, per_seq * batch


def run(layouts: list[dict[str, int]], batches: list[int], moe_impl: str = "dense", chip: str = "h200") -> list[dict]:
  cfg = ModelConfig.llada_moe_7b_a1b()
  rows = []
  for layout in layouts:
    mesh = topology_mesh(layout, chip)
    n = mesh.size
    for b in batches:
      r = {"layout": ",".join(f"{k}={v}" for k, v in layout.items()), "batch": b, "moe_impl": moe_impl,
           "chip": chip}
      for kind in ("cached", "refresh"):
        t0 = time.time()
        a = analyse(compile_forward(cfg, mesh, b, kind, moe_impl), n, chip)
        a["compile_s"] = time.time() - t0
        r[kind] = a
        print(f"{r['layout']:>18} B={b:<3} {kind:>7}: {a['flops'] / 1e12:7.3f} TFLOP {a['bytes'] / 1e9:7.2f} GB "
              f"args {a['arg_bytes'] / 2**30:6.2f} GiB temp {a['temp_bytes'] / 2**30:6.2f} GiB "
              f"coll {sum(e['count'] for e in a['collectives'].values()):3d} "
              f"({sum(e['bytes'] for e in a['collectives'].values()) / 2**20:7.1f} MiB) "
              f"t {a['t_forward_s'] * 1e3:6.2f} ms ({a['compile_s']:.0f}s compile)", file=sys.stderr)
      r["tps_per_seq"], r["tps_aggregate"] = predicted_tps(r["refresh"]["t_forward_s"], r["cached"]["t_forward_s"], b)
      r["realistic_tps_per_seq"], r["realistic_tps_aggregate"] = predicted_tps(
          r["refresh"]["t_realistic_s"], r["cached"]["t_realistic_s"], b)
      rows.append(r)
  return rows


def table(rows: list[dict]) -> str:
  gib, gb = 2**30, 1e9
  lines = ["| chip | mesh | batch | forward | per-device weights+cache | temp | TFLOP/dev | GB/dev | "
           "collectives (count: MiB) | roofline ms | collective ms | realistic ms | predicted TPS per seq (aggregate) "
           "| realistic TPS per seq (aggregate) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    for kind in ("cached", "refresh"):
      a = r[kind]
      colls = ", ".join(f"{k} {e['count']}: {e['bytes'] / 2**20:.1f}" for k, e in sorted(a["collectives"].items()))
      tps = f"{r['tps_per_seq']:.0f} ({r['tps_aggregate']:.0f})" if kind == "cached" else ""
      rtps = (f"{r['realistic_tps_per_seq']:.0f} ({r['realistic_tps_aggregate']:.0f})"
              if kind == "cached" and "realistic_tps_per_seq" in r else "")
      lines.append(f"| {r.get('chip', 'h200')} | {r['layout']} | {r['batch']} | {kind} | {a['arg_bytes'] / gib:.2f} GiB | "
                   f"{a['temp_bytes'] / gib:.2f} GiB | {a['flops'] / 1e12:.3f} | {a['bytes'] / gb:.2f} | "
                   f"{colls or 'none'} | {a['t_roofline_s'] * 1e3:.2f} | {a['t_collectives_s'] * 1e3:.2f} "
                   f"| {a.get('t_realistic_s', float('nan')) * 1e3:.2f} | {tps} | {rtps} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  ap.add_argument("--layouts", nargs="+", default=["tensor=8", "tensor=4,expert=2", "expert=8"])
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
  ap.add_argument("--moe-impl", default="dense", choices=["dense", "ragged"])
  ap.add_argument("--chip", default="h200", choices=sorted({*hardware.CHIPS, *hardware.TPUS}),
                  help="the chips of the mesh (TPUs need libtpu: pip install -e '.[tpu]')")
  ap.add_argument("--json", default=None, help="also write the raw numbers here")
  args = ap.parse_args(argv)
  layouts = [sharding.parse_mesh(s) for s in args.layouts]
  rows = run(layouts, args.batches, args.moe_impl, args.chip)
  print(table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
