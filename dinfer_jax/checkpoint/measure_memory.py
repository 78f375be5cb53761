"""Measures the peak host memory (max RSS) of hf2jax / jax2hf / load_converted on a generated checkpoint.

  python -m dinfer_jax.checkpoint.measure_memory [--size-gb 1.5] [--workdir DIR] [--keep] [--naive]

Writes a random bf16 HF LLaDA-MoE checkpoint (sharded, per-expert layout) of about --size-gb, then runs
each step in a fresh subprocess and reads that child's ru_maxrss with os.wait4. A bare import of the
converter (jax + orbax + tensorstore) is measured too, as the baseline to subtract. --naive also measures
the straightforward path (load_hf_params, then orbax StandardCheckpointer.save of the numpy tree) for
comparison. Not part of the default tests (tests/convert/test_convert_memory.py runs it, marked slow).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import ml_dtypes
import numpy as np

from dinfer_jax.checkpoint.keymap import expected_hf_keys, hf_dtype
from dinfer_jax.checkpoint.safetensors_io import OutTensor, WeightSet, write_checkpoint
from dinfer_jax.config import ModelConfig
from dinfer_jax.model.params import abstract_params


def make_config(size_gb: float) -> dict:
  """A LLaDA-MoE config (real-model proportions, smaller dims) with about size_gb of bf16 weights."""
  vocab, d, n_exp, f = 32768, 1024, 32, 512
  per_layer = 4 * d * d + 3 * n_exp * d * f + n_exp * d + 2 * d + 2 * 128
  layers = max(1, round((size_gb * 2**30 / 2 - 2 * vocab * d) / per_layer))
  return {"model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "vocab_size": vocab, "hidden_size": d,
          "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8,
          "expert_intermediate_size": f, "num_experts": n_exp, "num_experts_per_tok": 4,
          "shared_expert_intermediate_size": None, "qk_layernorm": True, "rope_theta": 50000.0,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "partial_rotary_factor": 1.0,
          "moe_router_enable_expert_bias": False, "mask_token_id": 32000, "eos_token_id": 32001,
          "pad_token_id": 32001, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def write_random_hf(directory: pathlib.Path, hf_config: dict, shard_gb: float = 0.5) -> dict:
  """Streams a random checkpoint to disk (one tensor in memory at a time)."""


  cfg = ModelConfig.from_hf_config(hf_config)
  directory.mkdir(parents=True)
  (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
  tensors = [OutTensor(k, hf_dtype(k, ml_dtypes.bfloat16), s) for k, s in expected_hf_keys(cfg).items()]
  rng = np.random.default_rng(0)

  def produce(t):
    return (rng.standard_normal(t.shape, dtype=np.float32) * 0.02).astype(t.dtype)

  write_checkpoint(directory, tensors, produce, max_shard_bytes=int(shard_gb * 2**30))
  leaves = jax.tree_util.tree_leaves(abstract_params(cfg))
  return {"model_bytes": sum(t.nbytes for t in tensors), "n_tensors": len(tensors),
          "largest_tensor_bytes": max(t.nbytes for t in tensors),
          "largest_leaf_bytes": max(math.prod(x.shape) * 2 for x in leaves), "layers": cfg.n_layers}


# A bare interpreter starts the measured command and reports its max RSS. Why not measure our own child:
# a forked child's ru_maxrss starts at the parent's RSS (fork shares the parent's pages until exec), so
# any step smaller than this (large) process would read as this process's size.
_LAUNCHER = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, ru = os.wait4(p.pid, 0)
print("MAXRSS_KIB", ru.ru_maxrss, os.waitstatus_to_exitcode(status), file=sys.stderr)
"""


def peak_rss(cmd: list[str]) -> tuple[int, float]:
  """Runs cmd, returns (its max RSS in bytes, seconds). Raises if it fails."""
  rss, secs, _ = peak_rss_out(cmd)
  return rss, secs


def peak_rss_out(cmd: list[str]) -> tuple[int, float, str]:
  """peak_rss, and the command's stdout."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  t0 = time.time()
  r = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, *cmd], env=env, capture_output=True, text=True)
  tail = [ln for ln in r.stderr.splitlines() if ln.startswith("MAXRSS_KIB")]
  if r.returncode != 0 or not tail or tail[-1].split()[2] != "0":
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
  return int(tail[-1].split()[1]) * 1024, time.time() - t0, r.stdout  # Linux reports KiB


# dinfer_jax.load onto a mesh of 8 fake CPU devices. A fake device's memory is host memory, so the placed
# shards count in the RSS: the child reports the bytes of their distinct buffers and the
# transient cost of loading is peak - baseline - resident.
_MESH_LOAD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, dinfer_jax
mesh = dinfer_jax.make_mesh(tensor=2, expert=4)
if sys.argv[1] != "-":
  m = dinfer_jax.load(sys.argv[1], dtype="bfloat16", mesh=mesh)
  jax.block_until_ready(m.params)
  bufs = {s.data.unsafe_buffer_pointer(): s.data.nbytes for x in jax.tree_util.tree_leaves(m.params)
          for s in x.addressable_shards}  # by buffer: a CPU client may share one buffer between devices
  print("RESIDENT", sum(bufs.values()))
  print("SPECS", sorted({str(x.sharding.spec) for x in jax.tree_util.tree_leaves(m.params)}))
else:
  print("RESIDENT", 0)
"""


def measure_mesh_load(size_gb: float, workdir: pathlib.Path) -> dict:
  """Peak RSS of dinfer_jax.load(path, mesh=tensor 2 x expert 4) from an HF and a converted checkpoint."""
  py = sys.executable
  info = write_random_hf(workdir / "hf", make_config(size_gb))
  subprocess.run([py, "-m", "dinfer_jax.checkpoint.cli", "hf2jax", str(workdir / "hf"), str(workdir / "jax_bf16")],
                 check=True, capture_output=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  results = {}
  for name, arg in (("baseline (import, 8 devices, mesh)", "-"), ("load HF onto mesh", str(workdir / "hf")),
                    ("load converted onto mesh", str(workdir / "jax_bf16"))):
    rss, secs, out = peak_rss_out([py, "-c", _MESH_LOAD, arg])
    resident = int(next(ln for ln in out.splitlines() if ln.startswith("RESIDENT")).split()[1])
    results[name] = {"peak_rss": rss, "seconds": secs, "resident": resident}
  return {"model": info, "steps": results}


_NAIVE = """
import sys, orbax.checkpoint as ocp
from dinfer_jax.checkpoint import load_hf_params
p = load_hf_params(sys.argv[1])
with ocp.StandardCheckpointer() as c:
  c.save(sys.argv[2], p)
"""


def measure(size_gb: float, workdir: pathlib.Path, naive: bool = False) -> dict:
  py = sys.executable
  hf_cfg = make_config(size_gb)
  info = write_random_hf(workdir / "hf", hf_cfg)
  steps = {
      "baseline (import jax, orbax, converter)": [py, "-c", "import jax, orbax.checkpoint, dinfer_jax.checkpoint; "
                                                   "jax.process_index()"],
      "hf2jax bf16": [py, "-m", "dinfer_jax.checkpoint.cli", "hf2jax", str(workdir / "hf"), str(workdir / "jax_bf16")],
      "hf2jax f32": [py, "-m", "dinfer_jax.checkpoint.cli", "hf2jax", str(workdir / "hf"), str(workdir / "jax_f32"), "--dtype", "float32"],
      "jax2hf bf16": [py, "-m", "dinfer_jax.checkpoint.cli", "jax2hf", str(workdir / "jax_bf16"), str(workdir / "hf_back")],
      "load_converted bf16": [py, "-c", "import sys; from dinfer_jax.checkpoint import load_converted; "
                              "import jax; p = load_converted(sys.argv[1])[0]; jax.block_until_ready(p)",
                              str(workdir / "jax_bf16")],
  }
  if naive:
    steps["naive: load_hf_params + StandardCheckpointer.save"] = [py, "-c", _NAIVE, str(workdir / "hf"),
                                                                  str(workdir / "naive")]
  results = {}
  for name, cmd in steps.items():
    rss, secs = peak_rss(cmd)
    results[name] = {"peak_rss": rss, "seconds": secs}
  # The round trip must be exact, or the numbers mean nothing.
  a, b = WeightSet(workdir / "hf"), WeightSet(workdir / "hf_back")
  assert sorted(a.keys()) == sorted(b.keys())
  for k in a.keys():
    assert np.asarray(a.read(k)).tobytes() == np.asarray(b.read(k)).tobytes(), k
  return {"model": info, "steps": results}


def report(r: dict) -> str:
  mib = lambda n: f"{n / 2**20:8.0f} MiB"
  m = r["model"]
  base = r["steps"]["baseline (import jax, orbax, converter)"]["peak_rss"]
  lines = [f"model: {m['layers']} layers, {m['n_tensors']} tensors, {mib(m['model_bytes'])} bf16; "
           f"largest HF tensor {mib(m['largest_tensor_bytes']).strip()}, largest param leaf "
           f"{mib(m['largest_leaf_bytes']).strip()} (bf16)",
           f"{'step':<52} {'peak RSS':>12} {'- baseline':>12} {'/ model':>8} {'seconds':>8}"]
  for name, s in r["steps"].items():
    extra = s["peak_rss"] - base
    lines.append(f"{name:<52} {mib(s['peak_rss']):>12} {mib(extra):>12} {extra / m['model_bytes']:8.2f} "
                 f"{s['seconds']:8.1f}")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--size-gb", type=float, default=1.5)
  ap.add_argument("--workdir", default=None, help="default: a temp dir, removed afterwards unless --keep")
  ap.add_argument("--keep", action="store_true")
  ap.add_argument("--naive", action="store_true", help="also measure load-everything + default orbax save")
  ap.add_argument("--json", action="store_true", help="print the raw numbers as JSON too")
  args = ap.parse_args(argv)
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="dinfer_mem_"))
  try:
    r = measure(args.size_gb, workdir, args.naive)
    print(report(r))
    if args.json:
      print(json.dumps(r, indent=2))
  finally:
    if not args.keep:
      shutil.rmtree(workdir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
