"""The roofline bench: loop-aware cost counting, the tiny preset end to end (CPU target), the CUDA target when
the plugin is installed."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from dinfer_jax import hardware
from dinfer_jax.bench import roofline


def _scan_matmuls(n_layers: int):
  def f(w, x):
    return jax.lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w)[0]
  w = jax.ShapeDtypeStruct((n_layers, 128, 128), jnp.float32)
  x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
  return jax.jit(f).lower(w, x).compile()


def test_module_cost_counts_loop_body_times_trip_count():
  per_layer = 2 * 32 * 128 * 128
  for n in (3, 7):
    mc = roofline.ModuleCost(roofline.compiled_text(_scan_matmuls(n)))
    flops = mc.total()["flops"]
    # tanh etc. add a little on top of the matmuls, never a whole layer.
    assert n * per_layer <= flops < (n + 0.5) * per_layer
    assert mc.unknown_trip_loops == 0
    # Every layer reads its [128, 128] weight slice at least once.
    assert mc.total()["bytes"] >= n * 128 * 128 * 4


def test_tiny_preset_cpu_target(tmp_path):
  out = tmp_path / "r.json"
  assert roofline.main(["--preset", "tiny", "--target", "cpu", "--batches", "1,2", "--caches", "dual,none",
                        "--json", str(out)]) == 0
  res = json.loads(out.read_text())
  assert res["target"] == "cpu" and "not a GPU prediction" in res["label"]
  kinds = {(r["batch"], r["cache"], r["kind"]) for r in res["rows"]}
  assert {(1, "dual", "refresh"), (1, "dual", "cached"), (1, "dual", "generate"), (2, "none", "full")} <= kinds
  for r in res["rows"]:
    if r["kind"] == "generate":
      assert r["host_ops"] == 0 and r["temp_bytes"] > 0
      continue
    assert r["flops"] >= r["routed_flops"] * 0.5 and r["bytes"] > 0 and r["floor_bytes"] > 0
    assert r["bytes_over_floor"] == pytest.approx(r["bytes"] / r["floor_bytes"])
    assert r["unknown_trip_loops"] == 0
  cached1 = [r for r in res["rows"] if (r["batch"], r["cache"], r["kind"]) == (1, "dual", "cached")][0]
  assert res["cached_bytes_over_floor_batch1"] == pytest.approx(cached1["bytes_over_floor"])
  p1 = [p for p in res["predictions"] if (p["batch"], p["cache"]) == (1, "dual")][0]
  assert res["predicted_tps_batch1"] == pytest.approx(p1["predicted_tps_per_seq"]) and p1["tpf"] == roofline.DINFER_TPF
  # The prediction is G tokens over (one refresh per block + the remaining G/TPF forwards cached).
  t = {r["kind"]: r["roofline_ms"] for r in res["rows"] if (r["batch"], r["cache"]) == (1, "dual") and "roofline_ms" in r}
  G, L = 64, 16
  gen_ms = (G // L) * t["refresh"] + (G / roofline.DINFER_TPF - G // L) * t["cached"]
  assert p1["predicted_tps_per_seq"] == pytest.approx(G / (gen_ms / 1e3))
  # The realistic figure costs the generate program's own iterations: with dual cache a refresh branch and a
  # cached step loop that picks nothing at run time; without a cache the step loop of full forwards.
  for cache in ("dual", "none"):
    g = [r for r in res["rows"] if (r["batch"], r["cache"], r["kind"]) == (1, cache, "generate")][0]
    p = [p for p in res["predictions"] if (p["batch"], p["cache"]) == (1, cache)][0]
    assert g["loop_step_fixed"] and g["loop_step_ms"] > 0 and g["loop_step_kernels"] > 0
    assert p["realistic_source"] == "generate program" and p["composed_realistic_tps_per_seq"] > 0
  assert g["loop_block_kernels"] >= 0


def test_prefix_windows_shrink_in_the_bench():
  """The prefix cache's cached forward has one row per window width (4 blocks of 16: 64, 32 and 16 tokens),
  cheaper as it narrows, and the prediction charges each block the width it runs."""
  res = roofline.run("tiny", ["h200"], [1], ["prefix"], "cpu", roofline.DINFER_TPF, with_generate=False,
                     progress=None)
  rows = {r["kind"]: r for r in res["rows"]}
  assert set(rows) == {"refresh", "cached", "cached@32", "cached@16"}
  assert [rows[k]["tokens"] for k in ("cached", "cached@32", "cached@16")] == [64, 32, 16]
  assert rows["cached@16"]["flops"] < rows["cached@32"]["flops"] < rows["cached"]["flops"]
  assert rows["cached@16"]["floor_bytes"] < rows["cached"]["floor_bytes"]
  G, L = 64, 16
  per_block = (G / roofline.DINFER_TPF - G // L) / (G // L)
  gen_ms = (G // L) * rows["refresh"]["roofline_ms"] + per_block * sum(
      rows[k]["roofline_ms"] for k in ("cached", "cached", "cached@32", "cached@16"))
  assert res["predictions"][0]["predicted_tps_per_seq"] == pytest.approx(G / (gen_ms / 1e3))


def test_weights_formats_side_by_side():
  """--weights: each format's forwards compiled from abstract QArray params, its floor at 1 byte per matmul
  weight, and the 8-bit summary fields beside bf16's."""
  res = roofline.run("tiny", ["h200"], [1], ["dual"], "cpu", roofline.DINFER_TPF, with_generate=False,
                     progress=None, weights=("bf16", "int8"))
  rows = {(r["weights"], r["kind"]): r for r in res["rows"]}
  assert set(rows) == {(w, k) for w in ("bf16", "int8") for k in ("refresh", "cached")}
  from dinfer_jax.bench import presets
  cfg = presets.get("tiny").model()
  D, N, K, H, F, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.expert_ffn_dim, cfg.n_experts
  # Every expert is touched at these token counts: 1 byte instead of 2 for q/k/v/o and the experts.
  saved = cfg.n_layers * (D * (2 * N * H + 2 * K * H) + E * 3 * D * F)
  for kind in ("refresh", "cached"):
    assert rows[("bf16", kind)]["floor_bytes"] - rows[("int8", kind)]["floor_bytes"] == pytest.approx(saved, rel=1e-3)
  c_b, c_q = rows[("bf16", "cached")], rows[("int8", "cached")]
  assert res["cached_bytes_int8_over_bf16_batch1"] == pytest.approx(c_q["bytes"] / c_b["bytes"])
  assert res["predicted_tps_batch1_int8"] > 0 and res["realistic_tps_batch1_int8"] > 0
  assert res["predicted_tps_batch1"] == pytest.approx(
      [p for p in res["predictions"] if p["weights"] == "bf16"][0]["predicted_tps_per_seq"])
  with pytest.raises(SystemExit, match="--weights"):
    roofline.main(["--preset", "tiny", "--target", "cpu", "--weights", "int4"])


@pytest.mark.parametrize("setting", ["threshold", "editing"])
def test_block_diffusion_is_predicted_from_its_own_forwards(setting):
  """LLaDA2's block diffusion: the prompt's prefill, the cross-block forward (the previous block and this one,
  2L queries; not for token editing, whose blocks settle on a forward that saw them) and the cached block
  forward; a generation is one prefill, per block one cross-block forward and the rest of G / TPF cached."""
  tpf = 3.08 if setting == "threshold" else None
  res = roofline.run("tiny_llada2", ["h200"], [1], ["dual"], "cpu", tpf, with_generate=True, progress=None,
                     setting=setting)
  rows = {r["kind"]: r for r in res["rows"]}
  G, L = 64, 16
  want = {"prefill", "cached"} | ({"cross"} if setting == "threshold" else set())
  assert set(rows) == want  # no generate program row: block diffusion is composed from its forwards
  assert rows["cached"]["tokens"] == L and rows["prefill"]["tokens"] == 16 and rows["prefill"]["step_ms"] == 0
  assert res["tpf"] == (3.08 if setting == "threshold" else roofline.LLADA21_S_TPF)
  t = {k: (r["realistic_ms"] + r["step_ms"]) / 1e3 for k, r in rows.items()}
  cross = G // L if setting == "threshold" else 0
  if cross:
    assert rows["cross"]["tokens"] == 2 * L and rows["cross"]["flops"] > rows["cached"]["flops"]
  gen_s = t["prefill"] + cross * t.get("cross", 0) + (G / res["tpf"] - cross) * t["cached"]
  assert res["predictions"][0]["realistic_tps_per_seq"] == pytest.approx(G / gen_s)
  with pytest.raises(ValueError, match="block diffusion does not run"):
    roofline.run("tiny_llada2", ["h200"], [1], ["dual"], "cpu", None, progress=None, setting="dinfer")


def test_bad_arguments():
  with pytest.raises(SystemExit, match="--batches"):
    roofline.main(["--preset", "tiny", "--target", "cpu", "--batches", "0"])
  with pytest.raises(SystemExit, match="--caches"):
    roofline.main(["--preset", "tiny", "--target", "cpu", "--caches", "full"])


@pytest.mark.skipif(not roofline.cuda_plugin_available(), reason="needs a CUDA plugin (pip install jax[cuda12] or jax[cuda13])")
def test_tiny_preset_deviceless_cuda(tmp_path):
  res = roofline.run("tiny", ["h200"], [1], ["dual"], "cuda", roofline.DINFER_TPF)
  rows = {r["kind"]: r for r in res["rows"]}
  assert set(rows) == {"refresh", "cached", "generate"}
  assert rows["cached"]["flops"] > 0 and rows["cached"]["unknown_trip_loops"] == 0
  # The GPU's own MoE kernels, lowered for the abstract GPU (jax 0.11 refuses without the topology's device):
  assert rows["cached"]["moe_impl"] == rows["refresh"]["moe_impl"] == "grouped/pallas-triton"
  assert rows["generate"]["host_ops"] == 0
  assert res["predicted_tps_batch1"] > 0
  # The realistic model: slower than the ideal, kernels counted from the module, host syncs from the loop.
  assert 0 < res["realistic_tps_batch1"] < res["predicted_tps_batch1"]
  assert res["kernels_per_cached_forward_batch1"] == rows["cached"]["kernels"] > 0
  assert rows["cached"]["realistic_ms"] > rows["cached"]["roofline_ms"] and rows["cached"]["step_ms"] > 0
  # The engine compiles its loop device-driven on GPU (loop.compiler_options): no host read per step; the same
  # program driven from the host reads one predicate per step (the step loop's condition) and a few per block.
  g = rows["generate"]
  assert g["device_loop"] and res["host_syncs_per_step"] == g["host_syncs_per_step"] == 0
  assert g["host_driven_syncs_per_step"] == 1 and 1 <= g["host_driven_syncs_per_block"] <= 3
  # The generate program's refresh iteration holds a forward and more: at least the refresh forward's kernels.
  assert g["loop_step_fixed"] and g["loop_entry_kernels"] >= rows["refresh"]["kernels"]


@pytest.mark.skipif(not roofline.cuda_plugin_available(), reason="needs a CUDA plugin (pip install jax[cuda12] or jax[cuda13])")
def test_device_loop_options_reach_the_compiled_module(tmp_path, monkeypatch):
  """XLA takes the engine's command-buffer option (WHILE, CONDITIONAL) for the compiled module: its dumped
  debug options list them; DINFER_JAX_DEVICE_LOOP=0 compiles without."""
  from dinfer_jax.engine import loop
  target = roofline.Target("cuda", roofline.CHIPS["h200"])

  def loop_fn(x):
    return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c * 2.0 + 1.0, x)
  args = target.abstract((jnp.ones((8,), jnp.float32),))
  for env, expect in (("1", True), ("0", False)):
    monkeypatch.setenv("DINFER_JAX_DEVICE_LOOP", env)
    dump = tmp_path / env
    opts = dict(loop.compiler_options("gpu"), xla_dump_to=str(dump))
    target.compile(loop_fn, *args, options=opts)
    text = "".join(p.read_text() for p in dump.glob("*debug_options*"))
    assert ("xla_gpu_enable_command_buffer: WHILE" in text and "xla_gpu_enable_command_buffer: CONDITIONAL" in text) == expect


@pytest.mark.skipif(not roofline.cuda_plugin_available(), reason="needs a CUDA plugin (pip install jax[cuda12] or jax[cuda13])")
def test_cached_forward_norms_queries_and_keys_in_one_kernel(monkeypatch):
  """7B-A1B batch-1 cached forward, deviceless H200, the engine's compile options: with queries and keys
  joined, one norm kernel per layer serves both (separate ones take one more per layer), and no weight is
  copied to join the two kernels (the GEMM reads them in place)."""
  from dinfer_jax.bench import presets, realistic
  from dinfer_jax.bench.throughput import forward_programs
  from dinfer_jax.engine import generate as gen_lib, loop
  from dinfer_jax.model import transformer
  target = roofline.Target("cuda", roofline.CHIPS["h200"])
  preset = presets.get("llada_moe_7b_a1b")
  cfg = preset.model()
  gcfg = roofline.generation_config(preset, "dual")
  lay, static = gen_lib.prepare(cfg, roofline._prompts(cfg, 1, preset.prompt_length), gcfg)
  aparams = target.abstract(roofline.abstract_inference_params(cfg, jnp.bfloat16))

  def compile_text() -> str:
    f, args = forward_programs(cfg, gcfg, lay, static, abstract_dtype=jnp.bfloat16, cache_out=True)["cached"]
    compiled, _ = target.compile(f, aparams, *target.abstract(args), donate=(2,),
                                 options=loop.compiler_options("gpu"))
    return roofline.compiled_text(compiled)

  def kernels(text: str) -> int:
    return realistic.kernels(realistic.Module(text), realistic.H200).total

  joined = compile_text()
  monkeypatch.setattr(transformer, "_joint_qk", lambda lp: False)
  separate = compile_text()
  assert kernels(joined) <= kernels(separate) - cfg.n_layers, (kernels(joined), kernels(separate))
  # The joined [D, (N + K) H] kernel exists only inside the GEMM's fusion, never as a buffer of its own.
  assert "wrapped_concatenate" not in joined


@pytest.mark.skipif(not roofline.cuda_plugin_available(), reason="needs a CUDA plugin (pip install jax[cuda12] or jax[cuda13])")
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_gpu_moe_runs_the_grouped_kernel_with_no_empty_blocks(weights):
  """7B-A1B batch-1 cached forward and refresh, deviceless H200: every MoE layer runs the project's kernel
  (gate/up as one, down as one: 2 per layer, 8-bit weights read as stored), no block of its grid is empty, and
  by the realistic model it beats the dense all-experts path at the cached window and tokamax's grid at the
  refresh."""
  import dataclasses

  from dinfer_jax.bench import presets, realistic
  from dinfer_jax.bench.throughput import forward_programs
  from dinfer_jax.engine import generate as gen_lib, loop
  target = roofline.Target("cuda", roofline.CHIPS["h200"])
  preset = presets.get("llada_moe_7b_a1b")
  base = preset.model()
  gcfg = roofline.generation_config(preset, "dual")
  lay, static = gen_lib.prepare(base, roofline._prompts(base, 1, preset.prompt_length), gcfg)
  aparams = target.abstract(roofline.abstract_inference_params(base, jnp.bfloat16, weights))

  def realistic_of(kind: str, moe_impl: str):
    cfg = dataclasses.replace(base, moe_impl=moe_impl)
    f, args = forward_programs(cfg, gcfg, lay, static, abstract_dtype=jnp.bfloat16, cache_out=True)[kind]
    compiled, _ = target.compile(f, aparams, *target.abstract(args), donate=(2,) if kind == "cached" else (),
                                 options=loop.compiler_options("gpu"))
    text = roofline.compiled_text(compiled)
    mod = realistic.Module(text)
    return text, realistic.forward_time(roofline.ModuleCost(text).total(), mod, realistic.H200)

  text, auto = realistic_of("cached", "auto")
  assert text.count("dinfer_grouped_swiglu_bm16_m768/") == text.count("dinfer_grouped_dot_bm16_m768/") == base.n_layers
  # The cached window's 96 tokens route in one kernel each layer (top-k, sort by expert, bounds).
  assert sum("custom-call(" in line and "dinfer_grouped_topk_align/" in line
             for line in text.splitlines()) == base.n_layers
  # ... and each block's output is normalised for the next in the combine's kernel: issue 20's kernel budget.
  assert sum("custom-call(" in line and "dinfer_grouped_combine_norm/" in line
             for line in text.splitlines()) == base.n_layers
  if weights == "bf16":
    assert auto["kernels"] <= 250
  assert auto["grouped_gemm_calls"] == 2 * base.n_layers and auto["grouped_gemm_empty_s"] == 0
  assert auto["dequantized_copy_bytes"] == 0
  _, dense = realistic_of("cached", "dense")
  assert auto["realistic_s"] < dense["realistic_s"]
  from dinfer_jax.model import moe
  if weights == "bf16" and moe.has_gpu_grouped_gemm():  # tokamax's kernel to compare with
    _, refresh = realistic_of("full", "auto")
    _, tokamax = realistic_of("full", "ragged")
    assert refresh["grouped_gemm_empty_s"] == 0 < tokamax["grouped_gemm_empty_s"]
    assert refresh["realistic_s"] < tokamax["realistic_s"]


def test_compiler_optimal_ms_reads_a_positive_estimate_only():
  """The target compiler's own roofline (XLA TPU's optimal_seconds) in ms; none where the compile gives none, a
  non-positive value (libtpu's -3.9999 s for tiny programs) or no cost analysis at all."""
  class Compiled:
    def __init__(self, cost):
      self.cost = cost

    def cost_analysis(self):
      if isinstance(self.cost, Exception):
        raise self.cost
      return self.cost
  assert roofline.compiler_optimal_ms(Compiled({"optimal_seconds": 0.0125})) == pytest.approx(12.5)
  assert roofline.compiler_optimal_ms(Compiled([{"optimal_seconds": 0.002}])) == pytest.approx(2.0)
  assert roofline.compiler_optimal_ms(Compiled({"optimal_seconds": -3.9999})) is None
  assert roofline.compiler_optimal_ms(Compiled({"flops": 1.0})) is None
  assert roofline.compiler_optimal_ms(Compiled(RuntimeError("no cost analysis"))) is None


def test_chip_specs_name_a_chip_or_a_tpu_slice():
  assert roofline.parse_chip("h200") == ("h200", 1)
  assert roofline.parse_chip("v6e") == ("v6e", 1)
  assert roofline.parse_chip("v6e-4") == ("v6e", 4)
  for bad, msg in (("a100", "unknown chip 'a100'"), ("h200-8", "slices are TPU ones"),
                   ("v6e-3", r"a v6e slice of \[1, 2, 4, 8, 16\] chips"), ("v5e-x", "a v5e slice")):
    with pytest.raises(ValueError, match=msg):
      roofline.parse_chip(bad)
  with pytest.raises(ValueError, match="slices are TPU ones"):
    roofline.Target("cpu", roofline.CHIPS["h200"], {"tensor": 2})
  with pytest.raises(SystemExit, match="unknown chip"):
    roofline.main(["--chips", "h300", "--target", "cpu"])


def test_memory_fit_from_two_batches_by_hand():
  """Per chip 16 bytes at batch 1, 44 at batch 8: 4 per row on 12 fixed; 100 bytes of HBM hold (100 - 12) // 4
  = 22 rows, or at batch 1 a canvas 22 times the compiled one (1000 positions)."""
  gen = lambda b, args, temp: {"kind": "generate", "batch": b, "tokens": 1000, "argument_bytes": args,  # noqa: E731
                               "temp_bytes": temp, "output_bytes": 1}
  rows = [gen(1, 10, 5), gen(8, 10, 33), {"kind": "cached", "batch": 1}]
  fit = roofline.memory_fit(rows, 100)
  assert fit["memory_per_chip_batch1_bytes"] == 16
  assert (fit["memory_per_row_bytes"], fit["memory_fixed_bytes"]) == (4, 12)
  assert fit["max_batch_per_chip"] == 22 and fit["max_canvas_batch1"] == 22000
  assert "max_batch_per_chip" not in roofline.memory_fit(rows[:1], 100)  # one batch: no slope


def test_a_program_that_overflows_the_chip_is_reported_not_raised(monkeypatch):
  """XLA TPU refuses a program that overflows HBM (v5e's 16 GB and the 7B-A1B in bf16): the bench lists the
  chip, batch and weights under does_not_fit and goes on; other compile errors still raise."""
  real = roofline.forward_rows

  def rows(target, preset, b, cache, **kw):
    if b == 2:
      raise RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                         "hbm. Used 17.2G of 15.75G hbm.")
    return real(target, preset, b, cache, **kw)
  monkeypatch.setattr(roofline, "forward_rows", rows)
  res = roofline.run("tiny", ["h200"], [1, 2], ["dual"], "cpu", progress=None, with_generate=False)
  assert [u["batch"] for u in res["does_not_fit"]] == [2] and "Ran out of memory" in res["does_not_fit"][0]["error"]
  assert {r["batch"] for r in res["rows"]} == {1} and res["realistic_tps_batch1"] > 0
  assert "does not fit" in roofline.markdown(res)
  monkeypatch.setattr(roofline, "forward_rows", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("INTERNAL: bad")))
  with pytest.raises(RuntimeError, match="INTERNAL"):
    roofline.run("tiny", ["h200"], [1], ["dual"], "cpu", progress=None, with_generate=False)


def test_a_program_that_compiles_but_outgrows_the_chip_is_reported(monkeypatch):
  """XLA TPU's compile checks arguments and temporaries apart, so a program can compile and still not fit: the
  bench adds one whose generate program needs more than the chip's HBM (arguments + temporaries + outputs)
  to does_not_fit and marks its prediction."""
  real = roofline.memory
  chip = hardware.CHIPS["h200"]

  def memory(compiled):  # every program a chip's worth of temporaries more; only generate ones are judged
    m = real(compiled)
    return dict(m, temp_bytes=m["temp_bytes"] + chip.memory_bytes)
  monkeypatch.setattr(roofline, "memory", memory)
  res = roofline.run("tiny", ["h200"], [1], ["dual"], "cpu", progress=None)
  gen = next(r for r in res["rows"] if r["kind"] == "generate")
  assert gen["argument_bytes"] + gen["temp_bytes"] > chip.memory_bytes
  [u] = res["does_not_fit"]
  assert (u["batch"], u["weights"]) == (1, "bf16") and u["error"].startswith("compiles, but needs")
  assert [p["fits"] for p in res["predictions"]] == [False] and "(over HBM)" in roofline.markdown(res)
  # One byte under the chip's HBM fits; forwards are not judged (the generate program holds them all).
  target = roofline.Target("cpu", chip)
  fits = dict(gen, argument_bytes=chip.memory_bytes - 2, temp_bytes=1, output_bytes=0)
  assert roofline.over_memory(fits, target) is None and roofline.over_memory(dict(fits, temp_bytes=3), target)
  assert roofline.over_memory(dict(fits, kind="cached", temp_bytes=10 ** 12), target) is None
