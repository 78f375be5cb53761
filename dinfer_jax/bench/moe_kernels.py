"""Measures the MoE expert kernels (dense all-experts einsum vs sort + ragged_dot) per token count.

python -m dinfer_jax.bench.moe_kernels [--d 512 --f 256 --e 64 --k 8 --dtype float32]
The numbers decide `moe.choose_impl`; they are recorded in BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from dinfer_jax import cli_help
from dinfer_jax.model import moe


def _time(fn, *args, reps=5):
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best


def main(argv=None):
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  ap.add_argument("--d", type=int, default=512)
  ap.add_argument("--f", type=int, default=256)
  ap.add_argument("--e", type=int, default=64)
  ap.add_argument("--k", type=int, default=8)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--tokens", default="16,64,256,1024")
  a = ap.parse_args(argv)
  dt = jnp.dtype(a.dtype)
  key = jax.random.PRNGKey(0)
  ks = jax.random.split(key, 5)
  ex = {"gate": (jax.random.normal(ks[0], (a.e, a.d, a.f)) / a.d ** 0.5).astype(dt),
        "up": (jax.random.normal(ks[1], (a.e, a.d, a.f)) / a.d ** 0.5).astype(dt),
        "down": (jax.random.normal(ks[2], (a.e, a.f, a.d)) / a.f ** 0.5).astype(dt)}
  print(f"backend={jax.default_backend()} D={a.d} F={a.f} E={a.e} k={a.k} dtype={a.dtype}")
  # On GPU also the project's grouped GEMM kernel (on CPU it runs in Pallas's interpreter: not a timing).
  names = ("dense", "ragged") + (("grouped",) if jax.default_backend() == "gpu" else ())
  print("| tokens | dense ms | ragged ms | dense GFLOP/s (routed) | ragged GFLOP/s | ragged/dense |"
        + (" grouped ms | grouped/dense |" if "grouped" in names else ""))
  print("|---|---|---|---|---|---|" + ("---|---|" if "grouped" in names else ""))
  for T in [int(t) for t in a.tokens.split(",")]:
    h = jax.random.normal(ks[3], (T, a.d)).astype(dt)
    logits = jax.random.normal(ks[4], (T, a.e))
    w, idx = jax.lax.top_k(jax.nn.softmax(logits), a.k)
    routed_flops = 2 * 3 * T * a.k * a.d * a.f
    res = {}
    for name in names:
      fn = jax.jit(lambda h, w, idx, ex, f=moe.EXPERT_KERNELS[name]: f(h, w, idx, ex, a.e))
      res[name] = _time(fn, h, w, idx.astype(jnp.int32), ex)
    print(f"| {T} | {res['dense']*1e3:.2f} | {res['ragged']*1e3:.2f} | {routed_flops/res['dense']/1e9:.1f} | "
          f"{routed_flops/res['ragged']/1e9:.1f} | {res['ragged']/res['dense']:.1f} |"
          + (f" {res['grouped']*1e3:.2f} | {res['grouped']/res['dense']:.2f} |" if "grouped" in res else ""))


if __name__ == "__main__":
  main()
