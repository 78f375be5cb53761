"""Per-device memory of the TD train step for LLaDA-MoE-7B-A1B on described H200s (deviceless compile).

  JAX_PLATFORMS=cpu python -m train_td.memory [--layouts data=1 tensor=8 tensor=2,expert=4]
      [--batch 8 --seq 1280] [--options plain,remat,remat+bf16] [--json out.json]

Needs the CUDA plugin next to CPU jax (`pip install "jax[cuda12]"`), no GPU and no weights: the step
(trainer.step_function of the TD loss with the masked-diffusion mix and certainty forcing on, i.e. two
forwards and their backward, AdamW with clipping) is compiled for 1 or 8 described H200s with abstract
fp32 master weights and Adam moments placed by the sharding rules table (parallel.state_shardings), params
and optimizer state donated as in training. XLA's memory analysis of the compiled module gives per device:
arguments (weights + moments + batch), temporaries (activations, gradients, workspace) and outputs not
aliased to a donated argument; their sum is what the device must hold at the peak of the step.

Options: plain (fp32 compute, activations of every layer kept for the backward pass), remat (gradient
checkpointing per layer), bf16 (forward/backward in bfloat16 on the fp32 master weights).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from dinfer_jax import sharding
from dinfer_jax.bench.mesh_compile import topology_mesh
from dinfer_jax.bench.roofline import deviceless_tokamax
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import moe, params as params_lib
from train_td import objective, parallel, trainer

HBM_GIB = 141.0  # H200 HBM3e (the 150.75e9 bytes the compile target describes, ~140.4 GiB usable)
OPTIONS = {"plain": dict(remat=False, compute_dtype="float32"),
           "remat": dict(remat=True, compute_dtype="float32"),
           "bf16": dict(remat=False, compute_dtype="bfloat16"),
           "remat+bf16": dict(remat=True, compute_dtype="bfloat16")}


def compile_td_step(cfg: ModelConfig, mesh, batch: int, seq: int, *, remat: bool, compute_dtype: str,
                    moe_impl: str = "ragged", mdm_weight: float = 0.5, cf_weight: float = 0.5,
                    target: str = "gpu"):
  """Lowers and compiles one TD train step for the mesh's devices (described H200s: target "gpu"; or this
  machine's CPU devices: target "cpu"); returns the compiled executable."""
  optimizer = trainer.make_optimizer(trainer.TrainConfig())
  loss_fn = objective.make_td_loss_fn(cfg, mdm_weight=mdm_weight, cf_weight=cf_weight, moe_impl=moe_impl,
                                      remat=remat, compute_dtype=compute_dtype)
  step = trainer.step_function(loss_fn, optimizer)
  p_sh, o_sh = parallel.state_shardings(cfg, optimizer, mesh)
  with_sharding = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
  params = jax.tree_util.tree_map(with_sharding, params_lib.abstract_params(cfg, jnp.float32), p_sh)
  opt_state = jax.tree_util.tree_map(with_sharding, jax.eval_shape(optimizer.init, params), o_sh)
  rows = NamedSharding(mesh, P("data"))
  repl = NamedSharding(mesh, P())
  field = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rows)  # noqa: E731
  batch_arrays = {"tokens": field((batch, seq), jnp.int32), "valid": field((batch, seq), jnp.bool_),
                  "positions": field((batch, seq), jnp.int32), "answer": field((batch, seq), jnp.bool_),
                  "reveal": field((batch, seq), jnp.int32), "n_steps": field((batch,), jnp.int32)}
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl)
  b_sh = jax.tree_util.tree_map(lambda _: rows, batch_arrays)
  jitted = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh, repl), out_shardings=(p_sh, o_sh, repl),
                   donate_argnums=(0, 1))
  # Kernel choices as on the GPU: the routed experts through tokamax's Triton grouped GEMM when installed
  # (XLA's own ragged_dot lowering on GPU computes every expert densely).
  with sharding.use_mesh(mesh), moe.target_backend(target), deviceless_tokamax(target == "gpu"):
    return jitted.lower(params, opt_state, batch_arrays, rng).compile()


def memory(compiled) -> dict:
  m = compiled.memory_analysis()
  arg, temp, out, alias = (int(m.argument_size_in_bytes), int(m.temp_size_in_bytes),
                           int(m.output_size_in_bytes), int(m.alias_size_in_bytes))
  peak = arg + temp + out - alias
  return {"arg_gib": arg / 2**30, "temp_gib": temp / 2**30, "out_not_aliased_gib": (out - alias) / 2**30,
          "peak_gib": peak / 2**30, "fits_h200": peak / 2**30 <= HBM_GIB}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m train_td.memory", description=__doc__.split("\n\n")[0])
  ap.add_argument("--layouts", nargs="+", default=["data=1", "tensor=8", "tensor=2,expert=4"],
                  help="mesh layouts (devices = product of the sizes)")
  ap.add_argument("--batch", type=int, default=8, help="global rows per step")
  ap.add_argument("--seq", type=int, default=1280, help="positions per row (prompt 256 + answer 1024)")
  ap.add_argument("--options", default="plain,remat,remat+bf16", help=f"comma-separated of {list(OPTIONS)}")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  cfg = ModelConfig.llada_moe_7b_a1b()
  opts = [o for o in args.options.split(",") if o]
  for o in opts:
    if o not in OPTIONS:
      ap.error(f"--options: unknown {o!r}; choose from {list(OPTIONS)}")
  counts = params_lib.count_params(cfg)
  print(f"LLaDA-MoE-7B-A1B: {counts['total'] / 1e9:.2f} B params; fp32 master weights {counts['total'] * 4 / 2**30:.1f}"
        f" GiB + Adam moments {counts['total'] * 8 / 2**30:.1f} GiB; batch {args.batch} x {args.seq} positions",
        file=sys.stderr)
  rows = []
  print("| devices | layout | option | arguments GiB | temporaries GiB | outputs GiB | peak GiB/device | fits 141 GiB |")
  print("|---|---|---|---|---|---|---|---|")
  try:
    layouts = [(text, sharding.parse_mesh(text)) for text in args.layouts]
  except ValueError as e:
    ap.error(str(e).replace("--mesh", "--layouts"))
  for text, layout in layouts:
    mesh = topology_mesh(layout)
    for o in opts:
      t0 = time.time()
      m = memory(compile_td_step(cfg, mesh, args.batch, args.seq, **OPTIONS[o]))
      row = dict(devices=mesh.size, layout=text, option=o, compile_s=round(time.time() - t0, 1), **m)
      rows.append(row)
      print(f"| {mesh.size} | {text} | {o} | {m['arg_gib']:.1f} | {m['temp_gib']:.1f} | "
            f"{m['out_not_aliased_gib']:.1f} | **{m['peak_gib']:.1f}** | {'yes' if m['fits_h200'] else 'no'} |",
            flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"batch": args.batch, "seq": args.seq, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
