"""GPU check: LLaDA-MoE-7B-A1B with random bf16 weights on one GPU, measured beside the roofline bench's
prediction for the same shapes.

dinfer_jax/bench/gpu_check.sh [OUT_DIR]                        # on the GPU machine (README, "GPU check")
python -m dinfer_jax.bench.gpu_check --out DIR                 # the same, with this Python
JAX_PLATFORMS=cpu python -m dinfer_jax.bench.gpu_check --tiny --out DIR   # the CPU rehearsal (test suite)

The roofline bench's exact shapes: prompt 256, gen 1024, block 64, dual cache, threshold 0.8, early stop;
items in this order (each skipped, and listed, once the time budget is spent: the check ends in about 6
minutes on an H200, compiles included, so a 15-minute slot has room for a rerun):
1. environment: asserts that JAX sees a GPU (--tiny: any device); jax/jaxlib/CUDA versions, the device;
2. per forward, batch 1: the refresh forward (whole canvas) and the cached forward (the block's window over
   the dual cache), each compiled once and timed alone as the loop runs it (the cache donated and carried
   from call to call), with the kernels of its compiled module (the MoE and attention implementations that
   ran, and the kernel count);
3. whole generate at batch 1 (threshold): wall time, forwards, forwards per second, tokens per second;
4. the same with dInfer's TPF setting (threshold 0.8 + iteration smoothing + vicinity 16/16/4);
5. the Python-stepped loop (a jitted forward per step, a host sync per step) on the batch-1 generation:
   the engine's speedup over it;
6. (GPU) item 3 with the host-driven loop (DINFER_JAX_DEVICE_LOOP=0) beside the device-driven one;
7. --weights fp8,int8 (8-bit weights, quantised on the device): items 2 and 3 per format;
8. batch 8: the forwards and the whole generate (per weight format).
Random weights decode about one token per forward, so the generate rows say forwards per second and the
prediction at the measured forward counts, not the trained model's tokens per second (tps_at_3.87_tpf is
forwards/s x 3.87 per sequence).

It writes gpu_check.json and gpu_check.md (measured beside predicted) into --out after every item, so a run
cut short keeps what it measured. Predictions come from the roofline bench's committed JSON files
(dinfer_jax/bench/predicted/*.json, the deviceless H200 compile of the same programs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from dinfer_jax import cli_help
from dinfer_jax.bench import presets, realistic, roofline
from dinfer_jax.bench.throughput import _best_time, forward_programs
from dinfer_jax.cli_common import QUANTIZE_CHOICES, is_quantize_spec
from dinfer_jax.config import MOE_IMPLS, ModelConfig
from dinfer_jax.engine import generate as gen_lib, loop
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.stepped import JitRunner, stepped_generate
from dinfer_jax.model import grouped_gemm, moe, params as params_lib, quant

DINFER_TPF = roofline.DINFER_TPF
PREDICTED_DIR = pathlib.Path(__file__).parent / "predicted"


def init_on_device(cfg: ModelConfig, dtype, seed: int = 0):
  """Random weights in the engine's per-layer layout, made by a jitted program so they are born on the
  device (no host copy, no second stacked copy)."""
  def make(key):
    return params_lib.unstack_layers(params_lib.init_params(cfg, key, dtype))
  return jax.jit(make)(jax.random.PRNGKey(seed))


def environment(allow_cpu: bool) -> dict[str, Any]:
  dev = jax.devices()[0]
  env = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
         "device": dev.device_kind, "devices": len(jax.devices()), "python": sys.version.split()[0]}
  try:
    env["platform_version"] = dev.client.platform_version  # e.g. "cuda 13000"
  except Exception:  # noqa: BLE001  informational only
    env["platform_version"] = None
  env["tokamax"] = moe.has_gpu_grouped_gemm()
  if env["backend"] != "gpu" and not allow_cpu:
    raise SystemExit(f"gpu_check: JAX sees no GPU (backend {env['backend']!r}, devices {jax.devices()}); "
                     "is the CUDA plugin on PYTHONPATH? (--tiny rehearses on CPU)")
  return env


def kernels_of(compiled) -> dict[str, Any]:
  """Which MoE and attention kernels the compiled module runs, and how many kernels it launches."""
  text = compiled.as_text()
  mod = realistic.Module(text)
  k = realistic.kernels(mod, realistic.H200)
  moe_name = ("dinfer-grouped-triton" if grouped_gemm.NAME in text
              else "tokamax-triton" if "__gpu$xla.gpu.triton" in text
              else "ragged-xla" if "ragged-dot" in text or "ragged_dot" in text else "dense")
  # The routing and combine kernels of the cached windows (grouped_gemm.topk_align, combine_normalize).
  moe_name += "".join(f"+{part}" for part in ("topk_align", "combine_norm") if f"{grouped_gemm.NAME}_{part}" in text)
  return {"kernels": k.total, "attention": "cudnn" if "__cudnn$fmha" in text else "xla", "moe": moe_name}


def _prompts(cfg: ModelConfig, batch: int, length: int) -> list[list[int]]:
  rng = np.random.default_rng(0)
  hi = min(cfg.vocab_size, 32000)
  bad = {cfg.mask_token_id, cfg.eos_token_id}
  return [[int(t) if int(t) not in bad else 7 for t in rng.integers(10, hi, size=length)] for _ in range(batch)]


def time_forwards(params, cfg, gcfg, lay, prog, reps: int) -> dict[str, dict[str, Any]]:
  """Per forward kind: compile once, then time it alone as the engine's loop runs it: a cached forward takes
  the cache donated and returns it (its K/V writes in place), and the next call takes what it returned."""
  out = {}
  for kind, (f, args) in forward_programs(cfg, gcfg, lay, prog, table=params["embed"], cache_out=True).items():
    cached = kind.startswith("cached")
    t = time.perf_counter()
    compiled = jax.jit(f, donate_argnums=(2,) if cached else ()).lower(params, *args).compile()
    compile_s = time.perf_counter() - t
    state = {"args": list(args)}

    def call():
      res = compiled(params, *state["args"])
      if cached:
        state["args"][1] = res[1]  # the returned cache feeds the next call (the donated one is gone)
      return res
    out["refresh" if kind == "full" else kind] = {"ms": 1e3 * _best_time(call, reps), "compile_s": compile_s,
                                                  **kernels_of(compiled)}
  return out


def time_generate(params, cfg, prompts, gcfg, repeats: int) -> dict[str, Any]:
  t = time.perf_counter()
  _, out, _ = gen_lib.generate_arrays(params, cfg, prompts, gcfg)
  jax.block_until_ready(out)
  first = time.perf_counter() - t
  walls = []
  for _ in range(repeats):
    t = time.perf_counter()
    _, out, _ = gen_lib.generate_arrays(params, cfg, prompts, gcfg)
    jax.block_until_ready(out)
    walls.append(time.perf_counter() - t)
  wall = min(walls)
  c = out.counters
  nfe, n_full, n_cached = int(c.nfe), int(c.n_full), int(c.n_cached)
  B, G = len(prompts), gcfg.gen_length
  return {"generate_s": wall, "compile_s": max(0.0, first - wall), "nfe": nfe, "n_full": n_full,
          "n_cached": n_cached, "fwd_per_s": nfe / wall, "tokens_per_s": B * G / wall,
          "tpf": G / nfe, "tps_at_3.87_tpf": DINFER_TPF * nfe / wall}


def time_stepped(params, cfg, prompt, gcfg) -> dict[str, Any]:
  """The same generation driven step by step from Python (engine.stepped with a JitRunner)."""
  runner = JitRunner()
  t = time.perf_counter()
  stepped_generate(params, cfg, prompt, gcfg, runner=runner)
  first = time.perf_counter() - t
  t = time.perf_counter()
  res = stepped_generate(params, cfg, prompt, gcfg, runner=runner)
  wall = time.perf_counter() - t
  return {"generate_s": wall, "compile_s": max(0.0, first - wall), "nfe": res.nfe, "fwd_per_s": res.nfe / wall}


# ----------------------------------------------------------------------------- predictions

def load_predictions(paths: list[pathlib.Path]) -> list[dict[str, Any]]:
  out = []
  for p in paths:
    try:
      out.append(json.loads(p.read_text()))
    except (OSError, ValueError) as e:
      print(f"gpu_check: no prediction from {p} ({e})", file=sys.stderr)
  return out


def predicted(preds: list[dict[str, Any]], preset: str, setting: str, batch: int,
              weights: str = "bf16") -> dict[str, Any] | None:
  """The roofline bench's rows for this preset, setting, batch and weight format (dual cache, first chip): per
  forward kind its ideal and realistic ms and the step's work outside it, and the generate program's host
  syncs and, where the bench costed them, its own iterations (loop: block entry, cached step, block body)."""
  for res in preds:
    if res.get("preset") != preset or res.get("setting") != setting:
      continue
    rows = [r for r in res["rows"] if r["batch"] == batch and r["cache"] == "dual"
            and r.get("weights", "bf16") == weights]
    if not rows:
      continue
    fwd = {r["kind"]: r for r in rows if r["kind"] != "generate"}
    gen = [r for r in rows if r["kind"] == "generate"]
    g = gen[0] if gen else {}
    loop = ({k: g[f"loop_{k}_ms"] for k in ("entry", "step", "block")}
            if g.get("loop_step_fixed") and "loop_entry_ms" in g else None)
    return {"fwd": fwd, "syncs_step": g.get("host_syncs_per_step", 0), "syncs_block": g.get("host_syncs_per_block", 0),
            "loop": loop, "source": res.get("command", "")}
  return None


def predicted_generate_s(pred: dict[str, Any], n_full: int, n_cached: int, blocks: int,
                         sync_us: float = realistic.H200.sync_us) -> dict[str, float]:
  """The prediction at the measured forward counts: ideal = forwards at their ideal roofline times;
  realistic = as the roofline bench charges it: the generate program's own iterations where it costed them
  (each full forward's iteration at the block entry's cost, each cached one at the step's, plus each block
  body's own work), else the forwards + the work outside them (composed_realistic_s either way); + host
  syncs."""
  f = pred["fwd"]
  ideal = 1e-3 * (n_full * f["refresh"]["roofline_ms"] + n_cached * f["cached"]["roofline_ms"])
  composed = 1e-3 * (n_full * (f["refresh"]["realistic_ms"] + f["refresh"]["step_ms"])
                     + n_cached * (f["cached"]["realistic_ms"] + f["cached"]["step_ms"]))
  loop = pred.get("loop")
  real = composed if not loop else 1e-3 * (n_full * loop["entry"] + n_cached * loop["step"] + blocks * loop["block"])
  syncs = 1e-6 * sync_us * ((n_full + n_cached) * pred["syncs_step"] + blocks * pred["syncs_block"])
  return {"ideal_s": ideal, "realistic_s": real + syncs, "composed_realistic_s": composed + syncs}


# ----------------------------------------------------------------------------- the check

@dataclasses.dataclass
class Check:
  args: argparse.Namespace
  t0: float = dataclasses.field(default_factory=time.perf_counter)
  res: dict[str, Any] = dataclasses.field(default_factory=dict)

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def item(self, name: str, est_s: float, fn):
    """Runs one item unless the budget cannot hold its estimate; records the result or why it was skipped."""
    left = self.args.budget_s - self.elapsed()
    if left < est_s:
      self.res["skipped"].append(f"{name}: {left:.0f} s of budget left, needs ~{est_s:.0f} s")
      return None
    t = time.perf_counter()
    try:
      out = fn()
    except Exception as e:  # noqa: BLE001  one failed item must not lose the others' numbers
      self.res["failed"].append(f"{name}: {type(e).__name__}: {e}")
      print(f"[{self.elapsed():.0f}s] {name} FAILED: {type(e).__name__}: {e}", flush=True)
      self.write()
      return None
    self.res["items"][name] = dict(out, item_s=time.perf_counter() - t)
    print(f"[{self.elapsed():.0f}s] {name}: {_short(out)}", flush=True)
    self.write()
    return out

  def write(self) -> None:
    if not self.args.out:
      return
    out = pathlib.Path(self.args.out)
    out.mkdir(parents=True, exist_ok=True)
    self.res["total_s"] = self.elapsed()
    for name, text in (("gpu_check.json", json.dumps(self.res, indent=1)), ("gpu_check.md", markdown(self.res))):
      tmp = out / (name + ".tmp")
      tmp.write_text(text)
      tmp.replace(out / name)


def _short(d: dict[str, Any]) -> str:
  keys = ("ms", "generate_s", "nfe", "fwd_per_s", "kernels", "moe", "attention", "engine_speedup")
  parts = []
  for k, v in d.items():
    if isinstance(v, dict):
      parts.append(f"{k} {{{_short(v)}}}")
    elif k in keys:
      parts.append(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}")
  return ", ".join(parts)


def shapes(args) -> dict[str, Any]:
  """The roofline bench's preset (tiny: its tiny preset in fp32) and its generation settings."""
  name = "tiny" if args.tiny else "llada_moe_7b_a1b"
  p = presets.get(name)
  cfg = p.model()
  if getattr(args, "moe_impl", "auto") != "auto":  # a rerun without the grouped kernels, should they fail there
    cfg = dataclasses.replace(cfg, moe_impl=args.moe_impl)
  return {"name": name, "cfg": cfg, "dtype": jnp.float32 if args.tiny else jnp.bfloat16,
          "P": p.prompt_length, "G": p.gen_length, "L": p.block_length,
          "gcfgs": {s: roofline.generation_config(p, "dual", s) for s in roofline.SETTINGS}}


def run(args: argparse.Namespace) -> dict[str, Any]:
  ck = Check(args)
  ck.res.update({"items": {}, "skipped": [], "failed": [], "tiny": bool(args.tiny),
                 "command": "python -m dinfer_jax.bench.gpu_check " + " ".join(args.argv)})
  ck.res["env"] = environment(allow_cpu=args.tiny)
  print(f"environment: {ck.res['env']}", flush=True)
  if args.compile_cache:
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  sh = shapes(args)
  cfg, G, L, P = sh["cfg"], sh["G"], sh["L"], sh["P"]
  ck.res["shape"] = {"config": sh["name"], "prompt": P, "gen": G, "block": L,
                     "dtype": jnp.dtype(sh["dtype"]).name, "cache": "dual"}
  t = time.perf_counter()
  params = jax.block_until_ready(init_on_device(cfg, sh["dtype"]))
  ck.res["init_s"] = time.perf_counter() - t
  gcfgs = sh["gcfgs"]
  preds = load_predictions([pathlib.Path(p) for p in args.predicted])
  blocks = -(-G // L)
  scale = 0.02 if args.tiny else 1.0  # budget estimates per item (s) on an H200; the tiny run is quick

  formats = {"bf16": params}

  def weights_of(w):
    """The params in weight format w, quantised on the device from the bf16 ones (model/quant.py)."""
    if w not in formats:
      qc = quant.QuantConfig.parse(w)
      formats[w] = jax.block_until_ready(jax.jit(lambda p: quant.quantize_params(p, qc))(params))
    return formats[w]

  def fwd_item(B, w="bf16", moe_impl=None):
    lay, prog = gen_lib.prepare(cfg, _prompts(cfg, B, P), gcfgs["threshold"])
    c = cfg if moe_impl is None else dataclasses.replace(cfg, moe_impl=moe_impl)
    res = time_forwards(weights_of(w), c, gcfgs["threshold"], lay, prog, args.reps)
    if moe_impl is not None:
      return res
    pred = predicted(preds, ck.res["shape"]["config"], "threshold", B, w)
    if pred:
      for kind, r in res.items():
        if kind in pred["fwd"]:
          r["predicted_ideal_ms"] = pred["fwd"][kind]["roofline_ms"]
          r["predicted_realistic_ms"] = pred["fwd"][kind]["realistic_ms"]
          r["predicted_kernels"] = pred["fwd"][kind]["kernels"]
    return res

  def gen_item(B, setting, w="bf16"):
    prompts = _prompts(cfg, B, P)
    out = time_generate(weights_of(w), cfg, prompts, gcfgs[setting], args.repeats)
    pred = predicted(preds, ck.res["shape"]["config"], setting, B, w)
    if pred:
      p = predicted_generate_s(pred, out["n_full"], out["n_cached"], blocks)
      out["predicted_ideal_s"], out["predicted_realistic_s"] = p["ideal_s"], p["realistic_s"]
    return out

  def host_loop_item():
    """generate_b1_threshold again with the host-driven loop (DINFER_JAX_DEVICE_LOOP=0: one predicate read per
    step instead of CUDA-graph conditional nodes): what the device loop is worth, or whether it runs at all."""
    saved = os.environ.get("DINFER_JAX_DEVICE_LOOP")
    os.environ["DINFER_JAX_DEVICE_LOOP"] = "0"
    loop.run_jit.cache_clear()
    try:
      out = gen_item(1, "threshold")
    finally:
      if saved is None:
        os.environ.pop("DINFER_JAX_DEVICE_LOOP", None)
      else:
        os.environ["DINFER_JAX_DEVICE_LOOP"] = saved
      loop.run_jit.cache_clear()
    dev = ck.res["items"].get("generate_b1_threshold")
    if dev:
      out["device_loop_speedup"] = out["generate_s"] / dev["generate_s"]
    return out

  def stepped_item():
    prompt = _prompts(cfg, 1, P)[0]
    out = time_stepped(params, cfg, prompt, gcfgs["threshold"])
    eng = ck.res["items"].get("generate_b1_threshold")
    if eng:
      out["engine_generate_s"] = eng["generate_s"]
      out["engine_speedup"] = out["generate_s"] / eng["generate_s"]
      out["same_nfe"] = out["nfe"] == eng["nfe"]
    return out

  if "bf16" in args.weights:
    ck.item("forwards_b1", 60 * scale, lambda: fwd_item(1))
    ck.item("generate_b1_threshold", 90 * scale, lambda: gen_item(1, "threshold"))
    ck.item("generate_b1_dinfer", 90 * scale, lambda: gen_item(1, "dinfer"))
    # The MoE kernel the engine picks on GPU (model/grouped_gemm.py) against XLA's dense all-experts GEMMs,
    # the same forwards: the kernel's first timing on a GPU decides whether it stays the default.
    ck.item("forwards_b1_dense_moe", 60 * scale, lambda: fwd_item(1, moe_impl="dense"))
    ck.item("stepped_b1_threshold", 45 * scale, stepped_item)
    if ck.res["env"]["backend"] == "gpu":
      ck.item("generate_b1_threshold_host_loop", 60 * scale, host_loop_item)
  # 8-bit weights (issue 21): the same batch-1 forwards and generation, quantised on the device.
  for w in args.weights:
    if w == "bf16":
      continue
    tag = quant.format_tag(w)
    ck.item(f"forwards_b1_{tag}", 60 * scale, lambda w=w: fwd_item(1, w))
    ck.item(f"generate_b1_threshold_{tag}", 90 * scale, lambda w=w: gen_item(1, "threshold", w))
  if 8 in args.batches:
    for w in args.weights:
      tag = "" if w == "bf16" else "_" + quant.format_tag(w)
      ck.item(f"forwards_b8{tag}", 45 * scale, lambda w=w: fwd_item(8, w))
      ck.item(f"generate_b8_threshold{tag}", 90 * scale, lambda w=w: gen_item(8, "threshold", w))
  ck.write()
  return ck.res


def markdown(res: dict[str, Any]) -> str:
  env = res.get("env", {})
  sh = res.get("shape", {})
  lines = [f"GPU check: {sh.get('config')} (prompt {sh.get('prompt')}, gen {sh.get('gen')}, block {sh.get('block')}, "
           f"{sh.get('dtype')}, dual cache) on {env.get('device')} ({env.get('backend')}, {env.get('platform_version')}), "
           f"jax {env.get('jax')} / jaxlib {env.get('jaxlib')}, tokamax {'yes' if env.get('tokamax') else 'no'}; "
           f"{res.get('total_s', 0):.0f} s", ""]
  items = res.get("items", {})
  fw = [(k, v) for k, v in items.items() if k.startswith("forwards_")]
  if fw:
    lines += ["| batch | forward | measured ms | predicted ideal ms | predicted realistic ms | kernels (predicted) "
              "| MoE | attention | compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, d in fw:
      for kind, r in d.items():
        if not isinstance(r, dict):
          continue
        lines.append(f"| {name.split('_b')[1]} | {kind} | {r['ms']:.2f} | {_f(r.get('predicted_ideal_ms'))} "
                     f"| {_f(r.get('predicted_realistic_ms'))} | {r['kernels']} ({r.get('predicted_kernels', '-')}) "
                     f"| {r['moe']} | {r['attention']} | {r['compile_s']:.1f} |")
    lines.append("")
  gens = [(k, v) for k, v in items.items() if k.startswith("generate_")]
  if gens:
    lines += ["| run | generate s | predicted ideal s | predicted realistic s | forwards (refresh + cached) | fwd/s "
              "| tokens/s (random weights) | fwd/s x 3.87 | compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in gens:
      lines.append(f"| {name[len('generate_'):]} | {r['generate_s']:.3f} | {_f(r.get('predicted_ideal_s'), 3)} "
                   f"| {_f(r.get('predicted_realistic_s'), 3)} | {r['nfe']} ({r['n_full']} + {r['n_cached']}) "
                   f"| {r['fwd_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['tps_at_3.87_tpf']:.0f} | {r['compile_s']:.1f} |")
    lines.append("")
  hl = items.get("generate_b1_threshold_host_loop")
  if hl and "device_loop_speedup" in hl:
    lines.append(f"Device-driven loop (CUDA-graph conditionals) vs host-driven (DINFER_JAX_DEVICE_LOOP=0), batch 1: "
                 f"{hl['device_loop_speedup']:.3f}x")
    lines.append("")
  st = items.get("stepped_b1_threshold")
  if st:
    lines.append(f"Python-stepped loop, batch 1: {st['generate_s']:.3f} s for {st['nfe']} forwards "
                 f"({st['fwd_per_s']:.1f} fwd/s)" + (f"; the engine is {st['engine_speedup']:.2f}x faster "
                                                     f"(same forwards: {st['same_nfe']})" if "engine_speedup" in st else ""))
    lines.append("")
  for key, title in (("skipped", "skipped"), ("failed", "failed")):
    if res.get(key):
      lines.append(f"{title}: " + "; ".join(res[key]))
  return "\n".join(lines)


def _f(x, nd: int = 2) -> str:
  return "-" if x is None else f"{x:.{nd}f}"


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  ap.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json and gpu_check.md")
  ap.add_argument("--tiny", action="store_true", help="the tiny preset, fp32, any device (the CPU rehearsal)")
  ap.add_argument("--batches", default="1,8", help="1 and/or 8 (batch 8 runs last)")
  ap.add_argument("--reps", type=int, default=5, help="timed calls per standalone forward (best)")
  ap.add_argument("--repeats", type=int, default=1, help="timed generate calls per run (best)")
  ap.add_argument("--budget-s", type=float, default=330.0,
                  help="items whose estimate no longer fits are skipped (the check must end within 6 minutes)")
  ap.add_argument("--compile-cache", default=os.environ.get("DINFER_JAX_GPU_CHECK_CACHE", "/tmp/dinfer_jax_gpu_cc"),
                  help="persistent compilation cache (a rerun skips the compiles); '' to disable")
  ap.add_argument("--weights", default="bf16",
                  help="comma list of weight formats to measure: bf16 (every item), int8, fp8, int8-block, fp8-block, "
                       "per-channel ones with +head/+embed/+a8 (batch-1 forwards and generate, then batch 8; a "
                       "second 6-minute run: --weights fp8,int8 or fp8+head+embed+a8)")
  ap.add_argument("--moe-impl", default="auto", choices=MOE_IMPLS,
                  help="the MoE kernels of every item (default: the engine's choice, on GPU the project's grouped "
                       "kernels; dense for a rerun in the same slot should they fail on the box)")
  ap.add_argument("--predicted", action="append", default=None,
                  help="roofline bench JSON(s) to compare with (default: dinfer_jax/bench/predicted/*.json)")
  args = ap.parse_args(argv)
  args.argv = argv
  try:
    args.batches = [int(b) for b in args.batches.split(",")]
  except ValueError:
    raise SystemExit(f"--batches {args.batches!r}: expected 1 and/or 8") from None
  if not set(args.batches) <= {1, 8} or 1 not in args.batches:
    raise SystemExit(f"--batches {args.batches}: expected 1 or 1,8")
  args.weights = [w.strip() for w in args.weights.split(",") if w.strip()]
  bad = [w for w in args.weights if w != "bf16" and not is_quantize_spec(w)]
  if bad or not args.weights:
    raise SystemExit(f"--weights {bad}: choose from bf16, {', '.join(QUANTIZE_CHOICES)}")
  if args.predicted is None:
    args.predicted = sorted(str(p) for p in PREDICTED_DIR.glob("*.json"))
  res = run(args)
  print(markdown(res))
  return 0 if not res["failed"] else 1


if __name__ == "__main__":
  sys.exit(main())
