"""GPU check: the LLaDA-MoE-7B-A1B shape with random bf16 weights, timed forwards and generate loops.

python -m dinfer_jax.bench.gpu_check --json out.json          # one H200, < 8 minutes (gpu_check.sh)
python -m dinfer_jax.bench.gpu_check --tiny --json out.json   # a tiny config on CPU (the smoke test)

What it measures (random weights, so decoding is forced to fixed work: the fixed_steps decoder commits k
tokens per forward, steps_per_block = block_length / k, early stop off):
- forward latency of the cached-slice forward (one 64-token block over the dual cache) and of the full
  refresh forward (the whole canvas), each timed alone (jitted, best of N, block_until_ready);
- forwards per second inside generate (NFE / wall time of the generate call after warm-up);
- the fraction of the HBM roofline: bytes a forward must read (the weights it touches plus the KV cache it
  attends to) / 4.8 TB/s against the measured forward time. A 64-token block at batch 1 routes 64 x 8 =
  512 token-expert pairs over 64 experts, so every expert is touched (and the dense MoE kernel the engine
  uses at <= 128 tokens reads them all anyway): a forward reads all attention, router and expert weights of
  every layer plus the LM head (logits for the block's tokens); of the embedding table only the looked-up
  rows;
- the TPS this implies at dInfer's 3.87 tokens per forward (their LLaDA-MoE threshold 0.8 + dual cache
  figure): 3.87 x forwards/s per sequence, x batch for the aggregate.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.bench.presets import tiny_config
from dinfer_jax.bench.throughput import time_forwards
from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import generate as gen_lib
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.model import params as params_lib

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e
BF16_FLOPS = 989e12  # H200 dense bf16 tensor-core peak
DINFER_TPF = 3.87  # dInfer, LLaDA-MoE, threshold 0.8 + dual cache + vicinity + smoothing (paper Table 1)


def init_on_device(cfg: ModelConfig, dtype, seed: int = 0):
  """Random weights created by a jitted program, so they are born on the device (no host copy)."""
  return jax.jit(params_lib.init_params, static_argnums=(0, 2))(cfg, jax.random.PRNGKey(seed), dtype)


def bytes_per_forward(cfg: ModelConfig, *, dtype_bytes: int, batch: int, tokens: int, kv_len: int,
                      logits_tokens: int) -> dict[str, float]:
  """Bytes one forward must move from HBM at least.

  weights: attention (q, k, v, o), norms, router, the touched experts of every layer, the LM head;
  embed: the looked-up rows; kv: the K/V of every layer the forward attends to (read) plus its own K/V.
  Expected distinct experts per layer for n routed pairs: E * (1 - (1 - k/E)^n)."""
  D, N, K, H, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
  attn = D * N * H * 2 + D * K * H * 2 + 2 * D + (2 * H if cfg.qk_norm else 0)
  per_layer = attn
  touched = 0.0
  if cfg.n_moe_layers:
    pairs = batch * tokens * cfg.n_experts_per_tok
    touched = cfg.n_experts * (1.0 - (1.0 - cfg.n_experts_per_tok / cfg.n_experts) ** pairs)
    expert = 3 * D * cfg.expert_ffn_dim
    moe = D * cfg.n_experts + touched * expert + 3 * D * cfg.shared_expert_ffn_dim
  dense = 3 * D * cfg.ffn_dim
  weights = (cfg.n_dense_layers * (per_layer + dense) + cfg.n_moe_layers * (per_layer + (moe if cfg.n_moe_layers else 0))
             + D + D * V) * dtype_bytes
  embed = batch * tokens * D * dtype_bytes
  kv = 2 * cfg.n_layers * batch * (kv_len + tokens) * K * H * dtype_bytes
  return {"weights": weights, "embed": embed, "kv": kv, "total": weights + embed + kv,
          "experts_touched_per_layer": touched, "logits_tokens": logits_tokens}


def flops_per_forward(cfg: ModelConfig, *, batch: int, tokens: int, kv_len: int, logits_tokens: int) -> float:
  """Matmul FLOPs of one forward (routed experts only; attention over kv_len keys)."""
  D, N, K, H, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
  proj = 2 * D * (2 * N * H + 2 * K * H)
  att = 2 * 2 * kv_len * N * H
  ffn_dense = 2 * 3 * D * cfg.ffn_dim
  ffn_moe = 2 * D * cfg.n_experts + 2 * 3 * D * cfg.expert_ffn_dim * cfg.n_experts_per_tok + 2 * 3 * D * cfg.shared_expert_ffn_dim
  per_tok = cfg.n_dense_layers * (proj + att + ffn_dense) + cfg.n_moe_layers * (proj + att + ffn_moe)
  return batch * (tokens * per_tok + logits_tokens * 2 * D * V)


def _prompts(cfg: ModelConfig, batch: int, length: int) -> list[list[int]]:
  rng = np.random.default_rng(0)
  hi = min(cfg.vocab_size, 32000)
  bad = {cfg.mask_token_id, cfg.eos_token_id}
  return [[int(t) if int(t) not in bad else 7 for t in rng.integers(10, hi, size=length)] for _ in range(batch)]


def run(args: argparse.Namespace, on_row=lambda partial: None) -> dict[str, Any]:
  """Runs the check; on_row(partial results) is called after every row (main writes the JSON each time, so a
  run cut short by a timeout still leaves what it measured)."""
  t_start = time.perf_counter()
  cfg = tiny_config() if args.tiny else ModelConfig.llada_moe_7b_a1b()
  dtype = jnp.float32 if args.tiny else jnp.bfloat16
  dtype_bytes = jnp.dtype(dtype).itemsize
  G = args.gen_length or (64 if args.tiny else 1024)
  L = args.block_length or (16 if args.tiny else 64)
  P = args.prompt_length or (16 if args.tiny else 64)
  t = time.perf_counter()
  params = jax.block_until_ready(init_on_device(cfg, dtype))
  init_s = time.perf_counter() - t
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
  rows, skipped = [], []
  batches = [int(b) for b in args.batches.split(",")]
  ks = [int(k) for k in args.ks.split(",")]
  for B in batches:
    prompts = _prompts(cfg, B, P)
    base = GenerationConfig(gen_length=G, block_length=L, decoder="fixed_steps", steps_per_block=L // ks[0],
                            cache="dual", early_stop=False, prompt_bucket=min(64, L))
    lay, static = gen_lib.prepare(cfg, prompts, base)
    grid = lay.grid
    if time.perf_counter() - t_start > args.budget_s:
      skipped.append(f"batch {B}: time budget spent")
      continue
    fwd = time_forwards(params, cfg, base, lay, static, reps=args.reps)
    Tc = grid.canvas_len
    traffic = {
        "cached": bytes_per_forward(cfg, dtype_bytes=dtype_bytes, batch=B, tokens=grid.window, kv_len=Tc, logits_tokens=L),
        "full": bytes_per_forward(cfg, dtype_bytes=dtype_bytes, batch=B, tokens=Tc, kv_len=0, logits_tokens=L),
    }
    flops = {
        "cached": flops_per_forward(cfg, batch=B, tokens=grid.window, kv_len=Tc, logits_tokens=L),
        "full": flops_per_forward(cfg, batch=B, tokens=Tc, kv_len=Tc, logits_tokens=L),
    }
    for k in ks:
      if time.perf_counter() - t_start > args.budget_s:
        skipped.append(f"batch {B}, k {k}: time budget spent")
        continue
      gcfg = base.replace(steps_per_block=max(1, L // k))
      t = time.perf_counter()
      _, out, _ = gen_lib.generate_arrays(params, cfg, prompts, gcfg)
      jax.block_until_ready(out)
      first = time.perf_counter() - t
      walls = []
      for _ in range(args.repeats):
        t = time.perf_counter()
        _, out, _ = gen_lib.generate_arrays(params, cfg, prompts, gcfg)
        jax.block_until_ready(out)
        walls.append(time.perf_counter() - t)
      wall = min(walls)
      nfe, n_full, n_cached = int(out["nfe"]), int(out["n_full"]), int(out["n_cached"])
      fps = nfe / wall
      row = {
          "batch": B, "k": k, "steps_per_block": gcfg.steps_per_block, "gen_length": G, "block_length": L,
          "prompt_length": P, "canvas_len": Tc,
          "cached_fwd_ms": 1e3 * fwd["cached"], "full_fwd_ms": 1e3 * fwd["full"],
          "hbm_roofline_cached_ms": 1e3 * traffic["cached"]["total"] / HBM_BYTES_PER_S,
          "hbm_roofline_full_ms": 1e3 * traffic["full"]["total"] / HBM_BYTES_PER_S,
          "compute_roofline_full_ms": 1e3 * flops["full"] / BF16_FLOPS,
          "compute_roofline_cached_ms": 1e3 * flops["cached"] / BF16_FLOPS,
          "generate_s": wall, "compile_s": max(0.0, first - wall), "nfe": nfe, "n_full": n_full,
          "n_cached": n_cached, "fwd_per_s_in_generate": fps,
          "tokens_per_s": B * G / wall,
          "implied_tps_per_seq_at_3.87_tpf": DINFER_TPF * fps, "implied_tps_aggregate_at_3.87_tpf": DINFER_TPF * fps * B,
          "loop_ms_per_fwd_minus_forwards": 1e3 * (wall - n_full * fwd["full"] - n_cached * fwd["cached"]) / nfe,
      }
      row["hbm_fraction_cached"] = row["hbm_roofline_cached_ms"] / row["cached_fwd_ms"]
      row["hbm_fraction_full"] = row["hbm_roofline_full_ms"] / row["full_fwd_ms"]
      row["engine_overhead"] = wall / (n_full * fwd["full"] + n_cached * fwd["cached"])
      rows.append(row)
      on_row(_result(cfg, dtype, dtype_bytes, n_params, L, P, G, init_s, t_start, rows, skipped))
  stepped = None
  if args.stepped_k:
    if time.perf_counter() - t_start < args.stepped_start_s:
      stepped = _stepped_row(params, cfg, G, L, P, args.stepped_k, rows)
    else:
      skipped.append("Python-stepped comparison: time budget spent")
  return _result(cfg, dtype, dtype_bytes, n_params, L, P, G, init_s, t_start, rows, skipped, stepped)


def _stepped_row(params, cfg, G, L, P, k, rows) -> dict[str, Any]:
  """The same generation (batch 1, fixed_steps k tokens per forward, dual cache) driven step by step from
  Python (engine.stepped with a JitRunner: a jitted forward per step and a host sync per step)."""
  from dinfer_jax.engine.stepped import JitRunner, stepped_generate
  gcfg = GenerationConfig(gen_length=G, block_length=L, decoder="fixed_steps", steps_per_block=max(1, L // k),
                          cache="dual", early_stop=False)
  prompt = _prompts(cfg, 1, P)[0]
  runner = JitRunner()
  t = time.perf_counter()
  stepped_generate(params, cfg, prompt, gcfg, runner=runner)
  first = time.perf_counter() - t
  t = time.perf_counter()
  res = stepped_generate(params, cfg, prompt, gcfg, runner=runner)
  wall = time.perf_counter() - t
  out = {"batch": 1, "k": k, "nfe": res.nfe, "generate_s": wall, "compile_s": max(0.0, first - wall),
         "fwd_per_s": res.nfe / wall}
  eng = [r for r in rows if r["batch"] == 1 and r["k"] == k]
  if eng:
    out["engine_generate_s"] = eng[0]["generate_s"]
    out["engine_speedup"] = wall / eng[0]["generate_s"]
    out["same_nfe"] = eng[0]["nfe"] == res.nfe
  return out


def _result(cfg, dtype, dtype_bytes, n_params, L, P, G, init_s, t_start, rows, skipped, stepped=None) -> dict[str, Any]:
  return {
      "stepped": stepped,
      "config": "llada_moe_7b_a1b" if cfg == ModelConfig.llada_moe_7b_a1b() else "tiny", "dtype": jnp.dtype(dtype).name, "params": n_params,
      "weight_bytes_per_forward": {"cached_b1": bytes_per_forward(cfg, dtype_bytes=dtype_bytes, batch=1, tokens=L,
                                                                  kv_len=P + G, logits_tokens=L)},
      "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops": BF16_FLOPS, "dinfer_tpf": DINFER_TPF,
      "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
      "init_s": init_s, "total_s": time.perf_counter() - t_start, "rows": rows, "skipped": skipped,
  }


def markdown(res: dict[str, Any]) -> str:
  lines = [f"{res['config']} ({res['params'] / 1e9:.2f}B params, {res['dtype']}) on {res['device']} "
           f"({res['backend']}), jax {res['jax']}",
           "",
           "| batch | k tok/fwd | cached fwd ms | HBM roofline ms | of roofline | full fwd ms | HBM / compute roofline ms "
           "| NFE | generate s | fwd/s in generate | engine overhead | TPS at 3.87 TPF (per seq / aggregate) | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    lines.append(
        f"| {r['batch']} | {r['k']} | {r['cached_fwd_ms']:.2f} | {r['hbm_roofline_cached_ms']:.2f} | "
        f"{100 * r['hbm_fraction_cached']:.0f}% | {r['full_fwd_ms']:.2f} | {r['hbm_roofline_full_ms']:.2f} / "
        f"{r['compute_roofline_full_ms']:.2f} | {r['nfe']} | {r['generate_s']:.2f} | {r['fwd_per_s_in_generate']:.1f} | "
        f"{r['engine_overhead']:.3f} | {r['implied_tps_per_seq_at_3.87_tpf']:.0f} / "
        f"{r['implied_tps_aggregate_at_3.87_tpf']:.0f} | {r['compile_s']:.1f} |")
  st = res.get("stepped")
  if st:
    lines.append("")
    lines.append(f"Python-stepped (jitted forward per step, host sync per step), batch 1, k {st['k']}: "
                 f"{st['generate_s']:.2f} s for {st['nfe']} forwards ({st['fwd_per_s']:.1f} fwd/s)"
                 + (f"; the engine is {st['engine_speedup']:.2f}x faster (same NFE: {st['same_nfe']})"
                    if "engine_speedup" in st else ""))
  if res["skipped"]:
    lines.append("")
    lines.append("skipped: " + "; ".join(res["skipped"]))
  w = res["weight_bytes_per_forward"]["cached_b1"]
  lines.append("")
  lines.append(f"bytes per cached forward at batch 1: weights {w['weights'] / 1e9:.2f} GB (experts touched per layer "
               f"{w['experts_touched_per_layer']:.1f}), KV {w['kv'] / 1e9:.3f} GB; HBM {res['hbm_bytes_per_s'] / 1e12:.1f} TB/s")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", dest="json_out", default=None, help="write the results here")
  ap.add_argument("--tiny", action="store_true", help="a tiny config, gen_length 64 (CPU smoke test)")
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--ks", default="1,4", help="tokens committed per forward (steps_per_block = block_length / k)")
  ap.add_argument("--gen-length", type=int, default=0)
  ap.add_argument("--block-length", type=int, default=0)
  ap.add_argument("--prompt-length", type=int, default=0)
  ap.add_argument("--repeats", type=int, default=1, help="timed generate calls per config (best)")
  ap.add_argument("--reps", type=int, default=5, help="timed calls per standalone forward (best)")
  ap.add_argument("--stepped-k", type=int, default=4,
                  help="also run the Python-stepped loop at batch 1 with this k (0: skip)")
  ap.add_argument("--stepped-start-s", type=float, default=300.0,
                  help="start the Python-stepped comparison only before this many seconds")
  ap.add_argument("--budget-s", type=float, default=400.0,
                  help="skip configs not yet started after this many seconds (the check must end in 8 minutes)")
  args = ap.parse_args(argv)
  def write(res):
    if args.json_out:
      pathlib.Path(args.json_out).write_text(json.dumps(res, indent=1))

  def on_row(res):
    write(res)
    r = res["rows"][-1]
    print(f"[{res['total_s']:.0f}s] batch {r['batch']} k {r['k']}: cached fwd {r['cached_fwd_ms']:.2f} ms, "
          f"full fwd {r['full_fwd_ms']:.2f} ms, {r['fwd_per_s_in_generate']:.1f} fwd/s in generate", flush=True)

  res = run(args, on_row)
  write(res)
  print(markdown(res))
  return 0


if __name__ == "__main__":
  sys.exit(main())
