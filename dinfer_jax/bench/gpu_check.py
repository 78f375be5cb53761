"""GPU check: LLaDA-MoE-7B-A1B with random bf16 weights on one GPU, measured beside the roofline bench's
prediction for the same shapes.

dinfer_jax/bench/gpu_check.sh [OUT_DIR]                        # on the GPU machine (README, "GPU check")
python -m dinfer_jax.bench.gpu_check --out DIR                 # the same, with this Python
JAX_PLATFORMS=cpu python -m dinfer_jax.bench.gpu_check --tiny --out DIR   # the CPU rehearsal (test suite)

The roofline bench's exact shapes: prompt 256, gen 1024, block 64, dual cache, threshold 0.8, early stop.
Every item runs in a process of its own with its own time limit (3x its estimate, within the budget left): an
XLA abort, a segfault or a hang costs that item alone, the summary names the item and how it died (signal or
exit status, its last lines: OUT/logs/ITEM.log) and the next item starts in a fresh process. Items run safest
first and are skipped, and listed, once the budget (330 s) cannot hold their estimate:
1. environment: asserts that JAX sees a GPU (--tiny: any device); jax/jaxlib/CUDA versions, the device, and
   with it the chip whose predictions the rest is compared with (hardware.CHIPS: H100 or H200);
2. safe: the batch-1 forwards and the whole generate with XLA's attention, dense MoE GEMMs and the
   host-driven loop (DINFER_JAX_DEVICE_LOOP=0), the kernels every jax GPU build runs;
3. the engine's own kernels: the batch-1 forwards (the refresh forward over the whole canvas and the cached
   forward over the block's window, each compiled once and timed alone as the loop runs it, the cache donated
   and carried) with the Pallas grouped GEMMs and cuDNN attention, and the kernels of each compiled module;
4. generate at batch 1 with the host-driven loop, then with the device-driven one (XLA command buffers with
   WHILE/CONDITIONAL): wall time, forwards, forwards per second; the difference says about how many host
   syncs per forward the device loop saves (0: its loops did not become graph conditionals);
5. dInfer's TPF setting (threshold 0.8 + iteration smoothing + vicinity 16/16/4);
6. the Python-stepped loop (a jitted forward per step, a host sync per step): the engine's speedup over it;
7. --weights fp8,int8 (8-bit weights, quantised on the device): the forwards and generate per format;
8. batch 8: the forwards and the whole generate (per weight format).
Random weights decode about one token per forward, so the generate rows say forwards per second and the
prediction at the measured forward counts, not the trained model's tokens per second (tps_at_3.87_tpf is
forwards/s x 3.87 per sequence). --tiny rehearses all of it on CPU with the tiny preset, the same processes,
ordering and budget, the grouped GEMMs in Pallas's interpreter.

It writes gpu_check.json and gpu_check.md (measured beside predicted) into --out after every item, so a run
cut short keeps what it measured. Predictions come from the roofline bench's committed JSON files
(dinfer_jax/bench/predicted/*.json: the deviceless H200 and H100 compiles of the same programs), the rows of
the chip the check runs on.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from dinfer_jax import cli_help, hardware
from dinfer_jax.bench import presets, realistic, roofline
from dinfer_jax.bench.throughput import _best_time, forward_programs
from dinfer_jax.cli_common import QUANTIZE_CHOICES, is_quantize_spec
from dinfer_jax.config import MOE_IMPLS, ModelConfig
from dinfer_jax.engine import generate as gen_lib
from dinfer_jax.engine.stepped import JitRunner, stepped_generate
from dinfer_jax.model import grouped_gemm, moe, quant
from dinfer_jax.model import params as params_lib

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
    x = jax.tree_util.tree_leaves(args[0])[0]  # the forward's tokens [B, T] (or their embeddings)
    n_tokens = x.shape[0] * x.shape[1]
    out["refresh" if kind == "full" else kind] = {"ms": 1e3 * _best_time(call, reps), "compile_s": compile_s,
                                                  "moe_impl": moe.choose_impl(cfg, n_tokens), **kernels_of(compiled)}
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
              weights: str = "bf16", chip: str | None = None) -> dict[str, Any] | None:
  """The roofline bench's rows for this preset, setting, batch, weight format and chip (its device name; None:
  the first chip that has rows; rows without a chip match any), dual cache: per forward kind its ideal and
  realistic ms and the step's work outside it, and the generate program's host syncs and, where the bench
  costed them, its own iterations (loop: block entry, cached step, block body)."""
  for res in preds:
    if res.get("preset") != preset or res.get("setting") != setting:
      continue
    rows = [r for r in res["rows"] if r["batch"] == batch and r["cache"] == "dual"
            and r.get("weights", "bf16") == weights and (chip is None or r.get("chip", chip) == chip)]
    if not rows:
      continue
    def one(rows):
      fwd = {r["kind"]: r for r in rows if r["kind"] != "generate"}
      gen = [r for r in rows if r["kind"] == "generate"]
      g = gen[0] if gen else {}
      loop = ({k: g[f"loop_{k}_ms"] for k in ("entry", "step", "block")}
              if g.get("loop_step_fixed") and "loop_entry_ms" in g else None)
      return {"fwd": fwd, "syncs_step": g.get("host_syncs_per_step", 0),
              "syncs_block": g.get("host_syncs_per_block", 0), "loop": loop, "source": res.get("command", "")}
    out = one(rows)
    # The range's ends (the bench's slow and fast charges), where the rows keep them.
    if all("cases" in r for r in rows):
      out["cases"] = {case: one(roofline.as_case(rows, case)) for case in ("slow", "fast")
                      if all(case in r["cases"] for r in rows)}
    return out
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

@dataclasses.dataclass(frozen=True)
class Item:
  """One measured item, run in a process of its own.

  est_s: its time on an H200 with its process's start (jax, the device, random weights), compiles included;
  safe: XLA's attention and dense MoE GEMMs under the host-driven loop, the kernels every jax GPU build runs;
  the others use the engine's own choices (the Pallas grouped GEMMs, cuDNN attention, the device-driven loop).
  """
  name: str
  kind: str  # "environment", "forwards", "generate" or "stepped"
  est_s: float
  batch: int = 1
  setting: str = "threshold"
  weights: str = "bf16"
  safe: bool = False
  host_loop: bool = False
  dump: bool = False  # XLA's thunk sequence of its programs (command_buffers reads it)

  def env(self) -> dict[str, str]:
    """The environment the item's process runs under (engine switches read when a program is traced)."""
    out = {}
    if self.safe or self.host_loop:
      out["DINFER_JAX_DEVICE_LOOP"] = "0"
    if self.safe:
      out["DINFER_JAX_ATTENTION"] = "xla"
    return out


def plan(args: argparse.Namespace) -> list[Item]:
  """The items in the order they run: the environment, then the safe items (they run on any jax GPU build),
  then the engine's own kernels and the device-driven loop (the ones a crash is likeliest in: XLA's
  command-buffer WHILE path, the Pallas-Triton kernels), then the 8-bit formats and batch 8."""
  items = [Item("environment", "environment", 20)]
  if "bf16" in args.weights:
    items += [Item("forwards_b1_safe", "forwards", 70, safe=True),
              Item("generate_b1_threshold_safe", "generate", 80, safe=True),
              Item("forwards_b1", "forwards", 70),
              Item("generate_b1_threshold_host_loop", "generate", 70, host_loop=True),
              Item("generate_b1_threshold", "generate", 80, dump=True),
              Item("generate_b1_dinfer", "generate", 80, setting="dinfer"),
              Item("stepped_b1_threshold", "stepped", 60)]
  for w in args.weights:  # 8-bit weights (issue 21): quantised on the device from the random bf16 ones
    if w != "bf16":
      tag = quant.format_tag(w)
      items += [Item(f"forwards_b1_{tag}", "forwards", 70, weights=w),
                Item(f"generate_b1_threshold_{tag}", "generate", 90, weights=w)]
  if 8 in args.batches:
    for w in args.weights:
      tag = "" if w == "bf16" else "_" + quant.format_tag(w)
      items += [Item(f"forwards_b8{tag}", "forwards", 60, batch=8, weights=w),
                Item(f"generate_b8_threshold{tag}", "generate", 90, batch=8, weights=w)]
  return items


def run_item(args: argparse.Namespace, item: Item) -> dict[str, Any]:
  """Runs one item in this process (the child's side): its environment, then its measurement."""
  print(f"gpu_check item {item.name}: started ({item.env() or 'the engine defaults'})", flush=True)
  # The rehearsal's crashes and hangs (tests/bench): DINFER_JAX_GPU_CHECK_FAIL=ITEM:abort,ITEM:hang.
  hooks = set(os.environ.get("DINFER_JAX_GPU_CHECK_FAIL", "").split(","))
  if f"{item.name}:abort" in hooks:
    os.abort()
  if f"{item.name}:hang" in hooks:
    time.sleep(10 ** 6)
  env = environment(allow_cpu=args.tiny)
  if item.kind == "environment":
    return {"env": env, "result": {"device": env["device"], "backend": env["backend"]}}
  if args.compile_cache:
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  sh = shapes(args)
  cfg, P = sh["cfg"], sh["P"]
  if item.safe:
    cfg = dataclasses.replace(cfg, moe_impl="dense")
  elif args.tiny and item.kind == "forwards" and cfg.moe_impl == "auto":
    # The engine's GPU kernels (model/grouped_gemm.py) through this same code path, in Pallas's interpreter.
    cfg = dataclasses.replace(cfg, moe_impl="grouped")
  t = time.perf_counter()
  params = jax.block_until_ready(init_on_device(sh["cfg"], sh["dtype"]))
  init_s = time.perf_counter() - t
  if item.weights != "bf16":
    qc = quant.QuantConfig.parse(item.weights)
    params = jax.block_until_ready(jax.jit(lambda p: quant.quantize_params(p, qc))(params))
  gcfg = sh["gcfgs"][item.setting]
  prompts = _prompts(cfg, item.batch, P)
  if item.kind == "forwards":
    lay, prog = gen_lib.prepare(cfg, prompts, gcfg)
    out = time_forwards(params, cfg, gcfg, lay, prog, args.reps)
  elif item.kind == "generate":
    out = time_generate(params, cfg, prompts, gcfg, args.repeats)
  else:
    out = time_stepped(params, cfg, prompts[0], gcfg)
  return {"env": env, "result": dict(out, init_s=init_s)}


_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")


def loop_thunks(text: str) -> dict[str, int]:
  """Reads a GPU thunk sequence as XLA dumps it (`N: kKind ...` lines, nested thunks indented under their
  parent): the while and conditional thunks XLA runs from the host (at the top level, or nested in other host
  loops) and those inside a command buffer (kCommandBuffer: captured into a CUDA graph, where a while is a
  graph conditional node and reads no predicate on the host)."""
  out = {"host_whiles": 0, "host_conditionals": 0, "graph_whiles": 0, "graph_conditionals": 0,
         "command_buffers": 0}
  stack: list[tuple[int, str]] = []  # (indent, kind) of the enclosing thunks
  for line in text.splitlines():
    m = _THUNK.match(line)
    if not m:
      continue
    indent, kind = len(m.group(1)), m.group(3)
    while stack and stack[-1][0] >= indent:
      stack.pop()
    in_graph = any(k == "kCommandBuffer" for _, k in stack)
    if kind == "kCommandBuffer":
      out["command_buffers"] += 1
    elif kind in ("kWhile", "kConditional"):
      what = "whiles" if kind == "kWhile" else "conditionals"
      out[f"{'graph' if in_graph else 'host'}_{what}"] += 1
    stack.append((indent, kind))
  return out


def command_buffers(dump: pathlib.Path, keep: pathlib.Path | None = None) -> dict[str, Any]:
  """What XLA made of the generate program's loops on this device, read off its thunk sequence after the
  thunk passes (command-buffer conversion is one; older XLA dumps only the sequence before them): whiles and
  conditionals left to the host (each iteration reads a predicate on the host) against those inside CUDA
  graphs. The largest program's file is read (the generate program); `keep` gets a copy of it."""
  files = sorted(dump.glob("*thunk_sequence_after_thunk_passes.txt")) or sorted(dump.glob("*thunk_sequence.txt"))
  if not files:
    return {"found": False, "why": f"no thunk sequence in XLA's dump ({len(list(dump.iterdir()))} files)"}
  f = max(files, key=lambda p: p.stat().st_size)
  text = f.read_text(errors="replace")
  if keep is not None:
    keep.write_text(text)
  return dict(loop_thunks(text), found=True, file=f.name, after_passes="after_thunk_passes" in f.name)


def command_buffer_line(cb: dict[str, Any]) -> str:
  """The markdown summary of command_buffers()."""
  if not cb.get("found"):
    return f"Loops on the device: unknown ({cb.get('why')})"
  host = cb["host_whiles"] + cb["host_conditionals"]
  as_run = "0 host syncs per step" if host == 0 else (
      f"{cb['host_whiles']} while(s) and {cb['host_conditionals']} conditional(s) left to the host: each "
      "iteration of those reads a predicate on the host")
  return (f"Loops on the device (XLA's thunks{' after its thunk passes' if cb['after_passes'] else ''}, "
          f"{cb['file']}): {cb['graph_whiles']} while(s) and {cb['graph_conditionals']} conditional(s) inside "
          f"{cb['command_buffers']} CUDA graph(s); {as_run}")


def _signal_name(returncode: int) -> str:
  try:
    return f"signal {signal.Signals(-returncode).name}"
  except ValueError:
    return f"signal {-returncode}"


@dataclasses.dataclass
class Check:
  """The driver: runs each item in a process of its own, within the time budget, and writes what it has after
  every item. A crash (an XLA abort, a segfault) or a hang costs that item alone: the summary says which item
  died and how (exit status or signal, its last lines) and the next item starts in a fresh process."""
  args: argparse.Namespace
  t0: float = dataclasses.field(default_factory=time.perf_counter)
  res: dict[str, Any] = dataclasses.field(default_factory=dict)
  preds: list[dict[str, Any]] = dataclasses.field(default_factory=list)

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def scale(self) -> float:
    return 0.1 if self.args.tiny else 1.0  # the tiny rehearsal's items take seconds (process start dominates)

  def run(self, item: Item) -> dict[str, Any] | None:
    est = item.est_s * self.scale()
    left = self.args.budget_s - self.elapsed()
    if left < est:
      self.res["skipped"].append(f"{item.name}: {left:.0f} s of budget left, needs ~{est:.0f} s")
      return None
    limit = min(left, self.args.item_limit_s or max(3 * est, est + 60))
    logs = pathlib.Path(self.args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path, result_path = logs / f"{item.name}.log", logs / f"{item.name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "dinfer_jax.bench.gpu_check", *self.args.argv, "--item", item.name,
           "--item-result", str(result_path)]
    env = dict(os.environ, **item.env())
    dump = None
    if item.dump:  # the compiled programs' thunks, for what XLA made of the loops (outside OUT: tens of MB)
      dump = pathlib.Path(tempfile.mkdtemp(prefix=f"gpu_check_{item.name}_"))
      # The generate program's module only (jit(run)): the forwards, weight init and quantisation are not read.
      env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_module_re=jit_run".strip()
    t = time.perf_counter()
    with open(log_path, "w") as log:
      proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
      try:
        rc = proc.wait(limit)
        how = None if rc == 0 else (_signal_name(rc) if rc < 0 else f"exit status {rc}")
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its whole process group: compile workers too
        proc.wait()
        how = f"hung: killed after {limit:.0f} s (its limit)"
    item_s = time.perf_counter() - t
    if how is None and not result_path.exists():
      how = "exited 0 without a result"
    if how is not None:
      tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-6:]
      self.res["failed"].append(f"{item.name}: {how}")
      self.res["died"][item.name] = {"how": how, "last_lines": tail, "item_s": item_s, "log": str(log_path)}
      print(f"[{self.elapsed():.0f}s] {item.name} FAILED ({how}): {' | '.join(tail[-2:])}", flush=True)
      self.write()
      return None
    got = json.loads(result_path.read_text())
    self.res.setdefault("env", got["env"])
    out = dict(got["result"], item_s=item_s, **({"safe": True} if item.safe else {}),
               **({"host_loop": True} if item.host_loop else {}))
    self.attach_prediction(item, out)
    if dump is not None:
      out["command_buffers"] = command_buffers(dump, keep=logs / f"{item.name}.thunk_sequence.txt")
      shutil.rmtree(dump, ignore_errors=True)
    self.res["items"][item.name] = out
    self.derive()
    print(f"[{self.elapsed():.0f}s] {item.name}: {_short(out)}", flush=True)
    self.write()
    return out

  def attach_prediction(self, item: Item, out: dict[str, Any]) -> None:
    if item.kind not in ("forwards", "generate"):
      return
    chip = self.res.get("chip") or {}
    pred = predicted(self.preds, self.res["shape"]["config"], item.setting, item.batch, item.weights,
                     chip=chip.get("name"))
    if not pred:
      return
    if item.kind == "forwards":
      for kind, r in out.items():
        if isinstance(r, dict) and kind in pred["fwd"]:
          r["predicted_ideal_ms"] = pred["fwd"][kind]["roofline_ms"]
          r["predicted_realistic_ms"] = pred["fwd"][kind]["realistic_ms"]
          r["predicted_kernels"] = pred["fwd"][kind]["kernels"]
    else:
      blocks = -(-self.res["shape"]["gen"] // self.res["shape"]["block"])
      p = predicted_generate_s(pred, out["n_full"], out["n_cached"], blocks, sync_us=self.sync_us())
      out["predicted_ideal_s"], out["predicted_realistic_s"] = p["ideal_s"], p["realistic_s"]
      ends = [predicted_generate_s(pred["cases"][c], out["n_full"], out["n_cached"], blocks,
                                   sync_us=self.sync_us())["realistic_s"] for c in ("slow", "fast")
              if c in pred.get("cases", {})]
      if len(ends) == 2:
        out["predicted_realistic_range_s"] = ends

  def sync_us(self) -> float:
    """One host predicate read on the chip found (the H200's charge off the table, and in the rehearsal)."""
    return realistic.CHARGES.get((self.res.get("chip") or {}).get("key"), realistic.H200).sync_us

  def derive(self) -> None:
    """The comparisons between items: the device-driven loop against the host-driven one, the engine's own
    kernels against the safe ones, the engine against the Python-stepped loop."""
    it = self.res["items"]
    dev, host, safe = (it.get(k) for k in ("generate_b1_threshold", "generate_b1_threshold_host_loop",
                                            "generate_b1_threshold_safe"))
    if dev and host:
      host["device_loop_speedup"] = host["generate_s"] / dev["generate_s"]
      # What the device loop saved per forward, in predicate reads at the chip's cost: about the host syncs
      # per step the device-driven loop no longer pays (0 when its loops did not become graph conditionals).
      host["saved_syncs_per_step"] = (host["generate_s"] - dev["generate_s"]) / (1e-6 * self.sync_us() * dev["nfe"])
    if host and safe:
      safe["engine_kernels_speedup"] = safe["generate_s"] / host["generate_s"]
    st = it.get("stepped_b1_threshold")
    if st and dev:
      st["engine_generate_s"] = dev["generate_s"]
      st["engine_speedup"] = st["generate_s"] / dev["generate_s"]
      st["same_nfe"] = st["nfe"] == dev["nfe"]

  def write(self) -> None:
    out = pathlib.Path(self.args.out)
    out.mkdir(parents=True, exist_ok=True)
    self.res["total_s"] = self.elapsed()
    for name, text in (("gpu_check.json", json.dumps(self.res, indent=1)), ("gpu_check.md", markdown(self.res))):
      tmp = out / (name + ".tmp")
      tmp.write_text(text)
      tmp.replace(out / name)


def _short(d: dict[str, Any]) -> str:
  keys = ("ms", "generate_s", "nfe", "fwd_per_s", "kernels", "moe", "attention", "engine_speedup", "device")
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


def chip_of(device_kind: str) -> dict[str, str] | None:
  """The hardware table's entry for a device kind ("NVIDIA H100 80GB HBM3"), as {key, name} for the JSON; None
  off the table."""
  chip = hardware.for_device_kind(device_kind)
  return None if chip is None else {"key": chip.key, "name": chip.name}


def run(args: argparse.Namespace) -> dict[str, Any]:
  """The parent's side: no device is touched here (the items' processes own it)."""
  ck = Check(args)
  sh = shapes(args)
  ck.res.update({"items": {}, "skipped": [], "failed": [], "died": {}, "tiny": bool(args.tiny),
                 "command": "python -m dinfer_jax.bench.gpu_check " + " ".join(args.argv),
                 "shape": {"config": sh["name"], "prompt": sh["P"], "gen": sh["G"], "block": sh["L"],
                           "dtype": jnp.dtype(sh["dtype"]).name, "cache": "dual"}})
  ck.preds = load_predictions([pathlib.Path(p) for p in args.predicted])
  items = plan(args)
  if ck.run(items[0]) is None:  # no device (or no jax): nothing else can run
    ck.res["skipped"] += [f"{it.name}: the environment item did not complete" for it in items[1:]]
    ck.write()
    return ck.res
  env = ck.res["env"]
  ck.res["chip"] = chip_of(env["device"])
  if ck.res["chip"] is None and env["backend"] == "gpu":
    ck.res["failed"].append(f"predictions: {env['device']!r} is not in hardware.CHIPS ({', '.join(hardware.CHIPS)}); "
                            "measured without predictions")
  print(f"environment: {env}; predictions for {(ck.res['chip'] or {}).get('name', 'the first chip')}", flush=True)
  wanted = None if args.items is None else {n.strip() for n in args.items.split(",") if n.strip()}
  unknown = sorted((wanted or set()) - {it.name for it in items})
  if unknown:
    raise SystemExit(f"--items: no item {unknown}; the items: {', '.join(it.name for it in items)}")
  for item in items[1:]:
    if (item.host_loop and env["backend"] != "gpu" and not args.tiny) or (wanted and item.name not in wanted):
      continue
    ck.run(item)
  ck.write()
  return ck.res


def markdown(res: dict[str, Any]) -> str:
  env = res.get("env", {})
  sh = res.get("shape", {})
  chip = (res.get("chip") or {}).get("name") or ("the first chip's (a rehearsal)" if env.get("backend") != "gpu"
                                                  else "none: the device is not in hardware.CHIPS")
  lines = [f"GPU check (predictions for {chip}): {sh.get('config')} (prompt {sh.get('prompt')}, gen {sh.get('gen')}, block {sh.get('block')}, "
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
      rng = r.get("predicted_realistic_range_s")
      lines.append(f"| {name[len('generate_'):]} | {r['generate_s']:.3f} | {_f(r.get('predicted_ideal_s'), 3)} "
                   f"| {_f(r.get('predicted_realistic_s'), 3)}{f' ({rng[0]:.3f}-{rng[1]:.3f})' if rng else ''} | {r['nfe']} ({r['n_full']} + {r['n_cached']}) "
                   f"| {r['fwd_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['tps_at_3.87_tpf']:.0f} | {r['compile_s']:.1f} |")
    lines.append("")
  hl = items.get("generate_b1_threshold_host_loop")
  if hl and "device_loop_speedup" in hl:
    lines.append(f"Device-driven loop (CUDA-graph conditionals) vs host-driven (DINFER_JAX_DEVICE_LOOP=0), batch 1: "
                 f"{hl['device_loop_speedup']:.3f}x, about {hl['saved_syncs_per_step']:.2f} host syncs saved per "
                 "forward (0: its loops did not become graph conditionals)")
    lines.append("")
  cb = (items.get("generate_b1_threshold") or {}).get("command_buffers")
  if cb:
    lines.append(command_buffer_line(cb))
    lines.append("")
  sf = items.get("generate_b1_threshold_safe")
  if sf and "engine_kernels_speedup" in sf:
    lines.append(f"The engine's kernels (Pallas grouped GEMM, cuDNN attention) vs the safe ones (dense MoE, XLA "
                 f"attention), host-driven loop, batch 1: {sf['engine_kernels_speedup']:.3f}x")
    lines.append("")
  st = items.get("stepped_b1_threshold")
  if st:
    lines.append(f"Python-stepped loop, batch 1: {st['generate_s']:.3f} s for {st['nfe']} forwards "
                 f"({st['fwd_per_s']:.1f} fwd/s)" + (f"; the engine is {st['engine_speedup']:.2f}x faster "
                                                     f"(same forwards: {st['same_nfe']})" if "engine_speedup" in st else ""))
    lines.append("")
  for name, d in res.get("died", {}).items():
    lines.append(f"{name} died ({d['how']}) after {d['item_s']:.0f} s; its last lines:")
    lines += [f"    {ln}" for ln in d["last_lines"]]
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
                  help="roofline bench JSON(s) to compare with (default: dinfer_jax/bench/predicted/*.json; the "
                       "rows of the chip the check runs on)")
  ap.add_argument("--items", default=None, metavar="NAME,...",
                  help="run only these items (and the environment), e.g. the ones a first run lost (default: all)")
  ap.add_argument("--item-limit-s", type=float, default=None,
                  help="kill an item's process after this long (default: 3x its estimate, at least +60 s, within "
                       "the budget left)")
  ap.add_argument("--item", default=None, help=argparse.SUPPRESS)  # the child's side: run this one item
  ap.add_argument("--item-result", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  args.argv = [a for i, a in enumerate(argv) if a not in ("--item", "--item-result")
               and (i == 0 or argv[i - 1] not in ("--item", "--item-result"))]
  try:
    args.batches = [int(b) for b in args.batches.split(",")]
  except ValueError:
    raise SystemExit(f"--batches {args.batches!r}: expected 1 and/or 8") from None
  if not set(args.batches) <= {1, 8} or 1 not in args.batches:
    raise SystemExit(f"--batches {args.batches}: expected 1 or 1,8")
  if not args.out:
    raise SystemExit("--out: give the folder for gpu_check.json, gpu_check.md and the items' logs")
  args.weights = [w.strip() for w in args.weights.split(",") if w.strip()]
  bad = [w for w in args.weights if w != "bf16" and not is_quantize_spec(w)]
  if bad or not args.weights:
    raise SystemExit(f"--weights {bad}: choose from bf16, {', '.join(QUANTIZE_CHOICES)}")
  if args.predicted is None:
    args.predicted = sorted(str(p) for p in PREDICTED_DIR.glob("*.json"))
  if args.item is not None:
    item = {it.name: it for it in plan(args)}[args.item]
    out = run_item(args, item)
    tmp = pathlib.Path(args.item_result + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(args.item_result)
    return 0
  res = run(args)
  print(markdown(res))
  return 0 if not res["failed"] else 1


if __name__ == "__main__":
  sys.exit(main())
