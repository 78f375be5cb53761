"""dinfer-jax bench and the GPU check, on the tiny golden model (fast)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest

from dinfer_jax import api, cli
from dinfer_jax.bench import floors, gpu_check, metrics, throughput
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine import generate as gen_lib
from dinfer_jax.engine.generate import count_generated, generate
from tests.engine.golden import MODEL_DIRS, load_model

GCFG = GenerationConfig(gen_length=16, block_length=8, cache="dual", threshold=0.9, mask_id=509, eos_id=506)
PROMPTS = [[3, 17, 42, 99, 7, 12, 200, 311, 45, 6, 8], [5, 9, 120, 33, 71]]


# ----------------------------------------------------------------------------- counting rules

def test_summarize_counting_rules():
  calls = [metrics.CallRecord(wall_s=2.0, num_tokens=[10, 4], row_nfe=[5, 4], nfe=6),
           metrics.CallRecord(wall_s=1.0, num_tokens=[3], row_nfe=[3], nfe=3, compile_s=0.5)]
  m = metrics.summarize(calls)
  assert m["per_seq_tps_mean"] == pytest.approx((10 / 2 + 4 / 2 + 3 / 1) / 3)
  assert m["aggregate_tps"] == pytest.approx(17 / 3)
  assert m["tpf"] == pytest.approx((10 / 5 + 4 / 4 + 3 / 3) / 3)
  assert m["nfe"] == 9 and m["tokens"] == 17 and m["fps"] == pytest.approx(3.0)
  assert m["compile_s"] == 0.5 and m["engine_overhead"] is None


def test_overhead_arithmetic():
  counts = {"full": 4, "cached": 10, "prefill": 0}
  pred = metrics.predicted_forward_time(counts, {"full": 0.01, "cached": 0.002})
  assert pred == pytest.approx(0.06)
  assert metrics.engine_overhead(0.066, pred) == pytest.approx(1.1)
  with pytest.raises(ValueError, match="cached"):
    metrics.predicted_forward_time(counts, {"full": 0.01})


def test_engine_overhead_uses_counts_times_stubbed_forward_times(monkeypatch):
  monkeypatch.setattr(throughput, "time_forwards", lambda *a, **k: {"full": 0.004, "cached": 0.001})
  monkeypatch.setattr(throughput, "time_forwards_chained", lambda *a, **k: {"full": 0.002, "cached": 0.0005})
  params, mcfg = load_model("A")
  (rec,) = throughput.run_engine(params, mcfg, [PROMPTS], GCFG, repeats=1)
  c = rec.forward_counts
  assert c["full"] > 0 and c["cached"] > 0 and c["prefill"] == 0
  assert c["full"] + c["cached"] == rec.nfe
  assert rec.predicted_forward_s == pytest.approx(0.004 * c["full"] + 0.001 * c["cached"])
  m = metrics.summarize([rec])
  assert m["engine_overhead"] == pytest.approx(rec.wall_min_s / rec.predicted_forward_s)
  assert m["engine_overhead_device"] == pytest.approx(rec.wall_min_s / (0.002 * c["full"] + 0.0005 * c["cached"]))


def test_prefix_overhead_charges_each_window_width(monkeypatch):
  """Prefix cache, 3 blocks of 8: cached forwards run windows of 24, 16 and 8 tokens; the predicted forward
  time charges each its own width's time (the forward kinds the bench times, throughput.forward_programs)."""
  times = {"full": 0.004, "cached": 0.003, "cached@16": 0.002, "cached@8": 0.001}
  monkeypatch.setattr(throughput, "time_forwards", lambda *a, **k: times)
  monkeypatch.setattr(throughput, "time_forwards_chained", lambda *a, **k: times)
  params, mcfg = load_model("A")
  gcfg = dataclasses.replace(GCFG, cache="prefix", gen_length=24)
  lay, static = gen_lib.prepare(mcfg, PROMPTS, gcfg)
  assert set(throughput.forward_programs(mcfg, gcfg, lay, static, table=params["embed"])) == set(times)
  (rec,) = throughput.run_engine(params, mcfg, [PROMPTS], gcfg, repeats=1)
  c = rec.forward_counts
  assert set(c) == set(times) | {"prefill"} and c["full"] + c["cached"] + c["cached@16"] + c["cached@8"] == rec.nfe
  assert c["cached@8"] > 0
  assert rec.predicted_forward_s == pytest.approx(sum(times[k] * c[k] for k in times))


def test_token_counts_match_count_generated_and_the_stepped_loop():
  params, mcfg = load_model("A")
  (rec,) = throughput.run_engine(params, mcfg, [PROMPTS], GCFG, repeats=1, overhead=False)
  res = generate((params, mcfg), PROMPTS, GCFG)
  want = [count_generated(row[len(p):], 506) for row, p in zip(res.canvas, PROMPTS)]
  assert rec.num_tokens == want == res.num_tokens
  assert rec.row_nfe == res.row_nfe and rec.nfe == res.nfe
  stepped = throughput.run_stepped(params, mcfg, PROMPTS, GCFG, repeats=1)
  assert [r.num_tokens[0] for r in stepped] == want  # same algorithms, same tokens
  assert [r.nfe for r in stepped] == res.row_nfe  # and the same forwards per row


def test_variant_configs():
  assert throughput.variant_config("fixed_steps", GCFG).steps_per_block == 8
  assert throughput.variant_config("fixed_steps", GCFG).cache == "none"
  d = throughput.variant_config("fastdllm_dual", GCFG.replace(cont_weight=0.3, cache="none"))
  assert (d.decoder, d.cache, d.cont_weight) == ("fastdllm", "dual", 0.0)
  probe = throughput.variant_config("overhead", GCFG, overhead_k=4)
  assert (probe.decoder, probe.steps_per_block, probe.early_stop, probe.gen_length) == ("fixed_steps", 2, False, 16)
  assert throughput.variant_config("overhead", GCFG, overhead_gen_length=20).gen_length == 24  # whole blocks


# ----------------------------------------------------------------------------- the CLI

def test_bench_cli_json(tmp_path, capsys):
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps(PROMPTS))
  out = tmp_path / "bench.json"
  rc = cli.main(["bench", "--model", str(MODEL_DIRS["A"]), "--prompts", str(prompts), "--mask-id", "509",
                 "--eos-id", "506", "--gen-length", "16", "--block-length", "8", "--cache", "dual",
                 "--repeats", "1", "--variants", "engine,stepped", "--no-progress", "--json", str(out)])
  assert rc == 0
  table = capsys.readouterr().out
  assert "| (a) engine (jitted loop) |" in table and "vs_python_stepped" in table
  d = json.loads(out.read_text())
  for key in ("per_seq_tps_mean", "aggregate_tps", "tpf", "nfe", "compile_s", "engine_overhead",
              "vs_python_stepped"):
    assert key in d, key
  assert d["per_seq_tps_mean"] > 0 and d["aggregate_tps"] > 0 and d["compile_s"] >= 0
  assert 1.0 <= d["tpf"] <= 8.0  # at least one token per forward, at most a block
  assert d["nfe"] == d["variants"]["stepped"]["nfe"]  # batch 1 engine and stepped loop: same forwards
  assert d["variants"]["engine"]["tokens"] == d["variants"]["stepped"]["tokens"]
  assert d["engine_overhead"] > 0 and math.isfinite(d["engine_overhead"])
  assert d["vs_python_stepped"] > 0
  assert d["vs_fixed_steps"] is None  # variant not run
  assert d["machine"]["jax"]


def test_bench_cli_bad_variant(capsys):
  assert cli.main(["bench", "--model", str(MODEL_DIRS["A"]), "--variants", "nope"]) == 2
  assert "nope" in capsys.readouterr().err


# ----------------------------------------------------------------------------- GPU check, tiny on CPU

def _prediction(setting: str) -> dict:
  """A roofline bench JSON for the tiny preset with hand-set times (the check's side-by-side arithmetic)."""
  def fwd(kind, ideal, real, step):
    return {"batch": 1, "cache": "dual", "kind": kind, "roofline_ms": ideal, "realistic_ms": real, "step_ms": step,
            "kernels": 100}
  return {"preset": "tiny", "setting": setting, "command": "hand-made",
          "rows": [fwd("refresh", 2.0, 3.0, 0.5), fwd("cached", 1.0, 1.5, 0.25),
                   {"batch": 1, "cache": "dual", "kind": "generate", "host_syncs_per_step": 1,
                    "host_syncs_per_block": 2}]}


def _write_predictions(tmp_path) -> list[str]:
  args = []
  for setting in ("threshold", "dinfer"):
    (tmp_path / f"{setting}.json").write_text(json.dumps(_prediction(setting)))
    args += ["--predicted", str(tmp_path / f"{setting}.json")]
  return args


def _check_rehearsal(d: dict, batch8: bool, weights: tuple[str, ...] = ()) -> None:
  assert d["env"]["backend"] == "cpu" and not d["skipped"] and not d["failed"]
  items = d["items"]
  expect = {"environment", "forwards_b1_safe", "generate_b1_threshold_safe", "forwards_b1",
            "generate_b1_threshold_host_loop", "generate_b1_threshold", "generate_b1_dinfer", "stepped_b1_threshold"}
  expect |= {f"{k}_{w}" for w in weights for k in ("forwards_b1", "generate_b1_threshold")}
  if batch8:
    expect |= {f"{k}{t}" for t in [""] + [f"_{w}" for w in weights] for k in ("forwards_b8", "generate_b8_threshold")}
  assert set(items) == expect
  for w in weights:  # the 8-bit runs decode the same prompts with the same program shapes
    g, q = items["generate_b1_threshold"], items[f"generate_b1_threshold_{w}"]
    assert q["nfe"] == q["n_full"] + q["n_cached"] and q["n_full"] == g["n_full"]
    assert items[f"forwards_b1_{w}"]["cached"]["kernels"] > 0
  for kind in ("refresh", "cached"):
    # The engine's own MoE kernels (the Pallas grouped GEMMs, in the interpreter on CPU) through the check's
    # code path; the safe item runs XLA's dense GEMMs and attention.
    r = items["forwards_b1"][kind]
    assert r["ms"] > 0 and r["kernels"] > 0 and r["moe_impl"] == "grouped" and r["attention"] == "xla"
    assert items["forwards_b1_safe"][kind]["moe_impl"] == "dense" and items["forwards_b1_safe"]["safe"]
  assert items["generate_b1_threshold_safe"]["nfe"] == items["generate_b1_threshold"]["nfe"]
  assert items["generate_b1_threshold_host_loop"]["device_loop_speedup"] > 0
  assert items["forwards_b1"]["cached"]["predicted_realistic_ms"] == 1.5
  g = items["generate_b1_threshold"]
  assert g["nfe"] == g["n_full"] + g["n_cached"] and g["n_full"] == 4  # one refresh per block
  # The prediction at the measured forward counts: hand-set forward times, 1 sync per step, 2 per block.
  sync = 15e-6
  assert g["predicted_ideal_s"] == pytest.approx(1e-3 * (2.0 * g["n_full"] + 1.0 * g["n_cached"]))
  assert g["predicted_realistic_s"] == pytest.approx(
      1e-3 * (3.5 * g["n_full"] + 1.75 * g["n_cached"]) + sync * (g["nfe"] * 1 + 4 * 2))
  st = items["stepped_b1_threshold"]  # the same generation stepped from Python: same forwards
  assert st["same_nfe"] and st["engine_speedup"] > 0


def test_gpu_check_script_rehearsal(tmp_path):
  """gpu_check.sh itself (the command the GPU machine runs: its python3, PYTHONPATH, no install) on CPU with
  the tiny preset: every batch-1 item runs in a process of its own, the JSON and markdown are written, each
  measurement sits beside the prediction at its forward counts. An XLA-style abort injected into one item
  costs that item alone: the summary names it, how it died and its last lines, and the items after it run."""
  out = tmp_path / "out"
  env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu", DINFER_JAX_SITE=str(tmp_path / "site"),
             DINFER_JAX_GPU_CHECK_FAIL="generate_b1_dinfer:abort")
  script = pathlib.Path(gpu_check.__file__).with_name("gpu_check.sh")
  # A compilation cache of its own, shared by the items' processes as on the GPU (each would compile the
  # random init and the common programs again).
  p = subprocess.run([str(script), str(out), "--tiny", "--batches", "1", "--reps", "1", "--compile-cache",
                      str(tmp_path / "xla"),
                      "--weights", "bf16", *_write_predictions(tmp_path)], env=env, capture_output=True,
                     text=True, timeout=300)
  d = json.loads((out / "gpu_check.json").read_text())
  assert p.returncode == 1 and d["failed"] == ["generate_b1_dinfer: signal SIGABRT"], p.stdout[-2000:]
  assert d["died"]["generate_b1_dinfer"]["last_lines"][-1].startswith("gpu_check item generate_b1_dinfer: started")
  assert "generate_b1_dinfer" not in d["items"]
  d["items"]["generate_b1_dinfer"], d["failed"] = {}, []  # the rest is the full rehearsal
  _check_rehearsal(d, batch8=False)
  md = (out / "gpu_check.md").read_text()
  assert "generate_b1_dinfer died (signal SIGABRT)" in md
  assert "Python-stepped loop" in md and "| 1 | cached |" in p.stdout and "stepped_b1_threshold" in d["items"]


def test_gpu_check_rehearsal_on_cpu(tmp_path):
  """The Python entry in-process, batch 8 included (the script test covers batch 1); the 8-bit item in W8A8
  with the 8-bit embedding table, activations 8-bit in every forward (+a8:0)."""
  out = tmp_path / "out"
  assert gpu_check.main(["--tiny", "--out", str(out), "--compile-cache", str(tmp_path / "xla"), "--reps", "1", "--weights",
                         "bf16,int8+head+embed+a8:0", *_write_predictions(tmp_path)]) == 0
  d = json.loads((out / "gpu_check.json").read_text())
  _check_rehearsal(d, batch8=True, weights=("int8_head_embed_a8_0",))
  assert "predicted_ideal_s" not in d["items"]["generate_b8_threshold"]  # no batch-8 prediction was given


def test_gpu_check_kills_a_hung_item(tmp_path):
  """An item that hangs is killed at its limit, its whole process group, and the summary says so (the script
  rehearsal has the crash)."""
  out = tmp_path / "out"
  env = dict(os.environ, JAX_PLATFORMS="cpu", DINFER_JAX_GPU_CHECK_FAIL="stepped_b1_threshold:hang")
  t = time.monotonic()
  p = subprocess.run([sys.executable, "-m", "dinfer_jax.bench.gpu_check", "--tiny", "--out", str(out), "--batches",
                      "1", "--compile-cache", "", "--item-limit-s", "6", "--items", "stepped_b1_threshold"],
                     env=env, capture_output=True, text=True, timeout=120)
  d = json.loads((out / "gpu_check.json").read_text())
  assert p.returncode == 1 and d["died"]["stepped_b1_threshold"]["how"] == "hung: killed after 6 s (its limit)"
  assert set(d["items"]) == {"environment"} and time.monotonic() - t < 60
  assert "stepped_b1_threshold died (hung" in (out / "gpu_check.md").read_text()


def test_gpu_check_compares_with_the_chip_it_runs_on():
  """H100 and H200 predictions side by side: the check reads the rows of the chip it finds."""
  assert gpu_check.chip_of("NVIDIA H100 80GB HBM3") == {"key": "h100", "name": "NVIDIA H100 80GB HBM3"}
  assert gpu_check.chip_of("NVIDIA H200") == {"key": "h200", "name": "NVIDIA H200"}
  assert gpu_check.chip_of("Tesla T4") is None
  preds = gpu_check.load_predictions(sorted(gpu_check.PREDICTED_DIR.glob("*.json")))
  h100 = gpu_check.predicted(preds, "llada_moe_7b_a1b", "threshold", 1, chip="NVIDIA H100 80GB HBM3")
  h200 = gpu_check.predicted(preds, "llada_moe_7b_a1b", "threshold", 1, chip="NVIDIA H200")
  assert h100 and h200
  # Less HBM bandwidth: each forward is predicted slower on the H100.
  assert h100["fwd"]["cached"]["realistic_ms"] > h200["fwd"]["cached"]["realistic_ms"]


def test_committed_predictions_cover_the_gpu_check():
  """The roofline bench's JSON files the GPU check compares with: both settings, batch 1 and 8, each with the
  refresh and cached forwards' ideal and realistic times and the generate program's host syncs."""
  preds = gpu_check.load_predictions(sorted(gpu_check.PREDICTED_DIR.glob("*.json")))
  for setting in ("threshold", "dinfer"):
    for batch in (1, 8):
      p = gpu_check.predicted(preds, "llada_moe_7b_a1b", setting, batch)
      assert p is not None, (setting, batch)
      for kind in ("refresh", "cached"):
        f = p["fwd"][kind]
        assert 0 < f["roofline_ms"] < f["realistic_ms"] and f["step_ms"] > 0 and f["kernels"] > 0
      assert p["syncs_step"] == 0  # compiled with the device-driven loop
      t = gpu_check.predicted_generate_s(p, 16, 1008, 16)
      assert 0 < t["ideal_s"] < t["realistic_s"] and t["ideal_s"] < t["composed_realistic_s"]
      # From the generate program's own iterations (both files cost them), as the bench's realistic figure.
      assert p["loop"] is not None
      assert t["realistic_s"] == pytest.approx(
          1e-3 * (16 * p["loop"]["entry"] + 1008 * p["loop"]["step"] + 16 * p["loop"]["block"]))
  # The 8-bit items (--weights fp8,int8) have theirs too: the threshold setting at batch 1 and 8, cheaper
  # cached forwards than bf16's.
  for w in ("int8", "fp8"):
    for batch in (1, 8):
      p, b = (gpu_check.predicted(preds, "llada_moe_7b_a1b", "threshold", batch, w),
              gpu_check.predicted(preds, "llada_moe_7b_a1b", "threshold", batch))
      assert p is not None, (w, batch)
      assert p["fwd"]["cached"]["realistic_ms"] < b["fwd"]["cached"]["realistic_ms"]
      assert p["fwd"]["cached"]["dequantized_copy_bytes"] == 0


def test_gpu_check_needs_a_gpu_without_tiny(tmp_path):
  """Without --tiny on a machine with no GPU the environment item says so, and nothing else runs."""
  assert gpu_check.main(["--out", str(tmp_path), "--compile-cache", "", "--batches", "1"]) == 1
  d = json.loads((tmp_path / "gpu_check.json").read_text())
  assert d["items"] == {} and d["died"]["environment"]["how"] == "exit status 1"
  assert "JAX sees no GPU" in d["died"]["environment"]["last_lines"][-1]
  assert len(d["skipped"]) == 7 and all("environment item did not complete" in s for s in d["skipped"])


def test_gpu_check_skips_what_the_budget_cannot_hold(tmp_path):
  out = tmp_path / "out"
  assert gpu_check.main(["--tiny", "--out", str(out), "--compile-cache", "", "--budget-s", "0.5",
                         "--batches", "1"]) == 0
  d = json.loads((out / "gpu_check.json").read_text())
  assert d["items"] == {} and len(d["skipped"]) == 8 and "budget" in d["skipped"][0]


def test_roofline_bytes_llada_moe():
  """At batch 1 a 64-token block touches (essentially) all 64 experts; the weights read are ~14 GB in bf16.
  LLaDA2-mini's 32-token block (top-8 of 256) touches about 163: each token misses an expert with
  probability 1 - 8/256."""
  cfg = floors.ModelConfig.llada_moe_7b_a1b()
  b = floors.bytes_per_forward(cfg, dtype_bytes=2, batch=1, tokens=64, kv_len=1088, logits_tokens=64)
  assert 63.98 < b["experts_touched_per_layer"] < 64
  assert 13.5e9 < b["weights"] < 14.5e9
  b = floors.bytes_per_forward(floors.ModelConfig.llada2_mini(), dtype_bytes=2, batch=1, tokens=32, kv_len=1280,
                               logits_tokens=32)
  assert b["experts_touched_per_layer"] == pytest.approx(256 * (1 - (1 - 8 / 256) ** 32)) == pytest.approx(163.3, abs=0.1)


@pytest.mark.skipif(not (pathlib.Path(api.DEFAULT_MODEL_DIR) / "config.json").exists(),
                    reason="the embedded default model is not installed")
def test_bench_default_model(tmp_path):
  """The defaults: the embedded model, its generation_config.json and the built-in text prompts."""
  out = tmp_path / "bench.json"
  assert cli.main(["bench", "--variants", "engine", "--repeats", "1", "--no-progress", "--json", str(out)]) == 0
  d = json.loads(out.read_text())
  assert d["prompts"] == len(throughput.TEXT_PROMPTS) and d["nfe"] > 0 and d["per_seq_tps_mean"] > 0


@pytest.mark.slow  # over 20 s on 2 cores: -m slow
def test_bench_preset_random_model(tmp_path):
  """--preset: a named shape with random weights; its gen/block length unless flags say otherwise."""
  out = tmp_path / "p.json"
  assert cli.main(["bench", "--preset", "tiny", "--variants", "engine,stepped", "--repeats", "1", "--gen-length", "16",
                   "--cache", "dual", "--no-progress", "--json", str(out)]) == 0
  res = json.loads(out.read_text())
  assert res["model"] == "preset:tiny" and res["prompts"] == 4
  assert res["config"]["gen_length"] == 16 and res["config"]["block_length"] == 16  # tiny preset's block
  eng, st = res["variants"]["engine"], res["variants"]["stepped"]
  assert eng["nfe"] == st["nfe"] and eng["tokens"] == st["tokens"]
  assert res["vs_python_stepped"] > 0



def test_box_install_keeps_what_the_machine_has(tmp_path, capsys):
  from dinfer_jax.bench import box_install
  wheels = tmp_path / "whl"
  wheels.mkdir()
  (wheels / "numpy-1.0-py3-none-any.whl").write_bytes(b"")  # present here: never installed
  assert box_install.dist_name(wheels / "typing_inspection-0.4.5-py3-none-any.whl") == "typing-inspection"
  assert box_install.main([str(wheels), str(tmp_path / "site")]) == 0
  assert "kept: numpy" in capsys.readouterr().out and not (tmp_path / "site").exists()


def test_gpu_check_moe_impl_flag_reaches_the_model_config():
  """A rerun without the grouped kernels (should they fail on the box): --moe-impl dense."""
  import argparse
  assert gpu_check.shapes(argparse.Namespace(tiny=True, moe_impl="dense"))["cfg"].moe_impl == "dense"
  assert gpu_check.shapes(argparse.Namespace(tiny=True, moe_impl="auto"))["cfg"].moe_impl == "auto"
  with pytest.raises(SystemExit):
    gpu_check.main(["--tiny", "--moe-impl", "nope"])


@pytest.mark.parametrize("cont_weight", [0.0, 0.3])
def test_forward_programs_take_the_engines_logits(cont_weight):
  """The benched forwards have the engine loop's logits: the block's, or with smoothing the refresh's over
  the generation region (from the first block: the prompt holds no mask) and the cached one's over its window."""
  import jax
  import jax.numpy as jnp

  from dinfer_jax.bench import presets, roofline
  cfg = presets.get("tiny").model()
  gcfg = GenerationConfig(gen_length=64, block_length=16, cache="dual", threshold=0.8, prompt_bucket=16,
                          cont_weight=cont_weight)
  lay, static = gen_lib.prepare(cfg, [list(range(10, 30))], gcfg)
  grid = lay.grid
  params = roofline.abstract_inference_params(cfg, jnp.float32)
  shapes = {k: jax.eval_shape(f, params, *args)[0].shape[1] for k, (f, args) in throughput.forward_programs(
      cfg, gcfg, lay, static, abstract_dtype=jnp.float32, cache_out=True).items()}
  want = ({"full": grid.canvas_len - grid.first_block, "cached": grid.window} if cont_weight
          else {"full": grid.block_len, "cached": grid.block_len})
  assert grid.first_block > 0 and shapes == want
