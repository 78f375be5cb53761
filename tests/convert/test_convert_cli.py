"""`python -m convert` smoke tests in subprocesses."""
import json
import os
import pathlib
import subprocess
import sys

from ckpt_testlib import MODELS, copy_model, leftovers, raw_tensors

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "convert", *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)


def test_inspect_golden():
  r = _run("inspect", MODELS["llada_moe"])
  assert r.returncode == 0, r.stderr
  assert "model.layers.1.mlp.experts.7.down_proj.weight" in r.stdout
  assert r.stdout.strip().splitlines()[-1] == "69 tensors, 189,824 params, 0.4 MiB"


def test_hf2jax_jax2hf_inspect(tmp_path):
  r = _run("hf2jax", MODELS["llada2_moe"], tmp_path / "j", "--dtype", "float32")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("hf2jax: llada2_moe (per_expert, bfloat16)") and "130 tensors, 338,496 params" in r.stdout
  assert json.loads((tmp_path / "j" / "dinfer_jax.json").read_text())["dtype"] == "float32"
  r = _run("inspect", tmp_path / "j", "--limit", "3")
  assert r.returncode == 0 and "dense_layers.attn_norm" in r.stdout and "... 27 more" in r.stdout
  r = _run("jax2hf", tmp_path / "j", tmp_path / "h", "--dtype", "bfloat16", "--layout", "per_expert")
  assert r.returncode == 0, r.stderr
  assert raw_tensors(tmp_path / "h") == raw_tensors(MODELS["llada2_moe"])


def test_error_exit_code_and_one_line(tmp_path):
  src = copy_model("llada", tmp_path / "src")
  (src / "config.json").unlink()
  r = _run("hf2jax", src, tmp_path / "out")
  assert r.returncode == 2
  lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: ") and "config.json not found" in lines[0], r.stderr
  assert "Traceback" not in r.stderr and r.stdout == ""
  assert leftovers(tmp_path, "out") == []


def test_refuses_existing_dst(tmp_path):
  (tmp_path / "out").mkdir()
  r = _run("hf2jax", MODELS["llada"], tmp_path / "out")
  assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
  r = _run("hf2jax", MODELS["llada"], tmp_path / "out", "--overwrite")  # not ours: must be named
  assert r.returncode == 2 and "--overwrite-unmarked" in r.stderr, r.stderr
  r = _run("hf2jax", MODELS["llada"], tmp_path / "out", "--overwrite", "--overwrite-unmarked", tmp_path / "other")
  assert r.returncode == 2 and "is not DST" in r.stderr, r.stderr
  r = _run("hf2jax", MODELS["llada"], tmp_path / "out", "--overwrite", "--overwrite-unmarked", tmp_path / "out")
  assert r.returncode == 0, r.stderr
  r = _run("hf2jax", MODELS["llada"], tmp_path / "out", "--overwrite")  # now it is ours
  assert r.returncode == 0, r.stderr
