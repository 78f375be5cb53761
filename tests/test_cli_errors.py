"""dinfer-jax generate: errors name their source (issue 14, item 7), one line, exit status 2."""
import json
import pathlib
import shutil

import numpy as np
import pytest

from dinfer_jax import api, cli, diagnostics

GOLDEN_A = pathlib.Path(__file__).parent / "golden" / "decode" / "A"
KNOBS = ["--gen-length", "16", "--block-length", "8"]


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  shutil.copytree(src, dst)
  for f in dst.iterdir():
    f.chmod(0o644)  # golden files are read-only; tests edit their copies
  return dst


def _fails(argv, capsys, *wants):
  assert cli.main(["generate", *map(str, argv)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith("error: "), err
  for w in wants:
    assert w in err, err
  return err


def test_broken_generation_config_names_the_file(tmp_path, capsys):
  d = _copy(GOLDEN_A, tmp_path / "m")
  (d / "generation_config.json").write_text('{"gen_length": 16,')
  _fails(["--model", d, *KNOBS, "1,2,3"], capsys, f"{d / 'generation_config.json'}: cannot parse")


def test_bad_value_from_generation_config_says_so(tmp_path, capsys):
  d = _copy(GOLDEN_A, tmp_path / "m")
  (d / "generation_config.json").write_text('{"threshold": 1.5, "cache": "dual"}')
  _fails(["--model", d, *KNOBS, "1,2,3"], capsys, str(d / "generation_config.json"), "threshold=1.5",
         "override it with the matching flag")
  # The same bad value given as a flag is the flag's fault, and the flag overrides the file.
  err = _fails(["--model", GOLDEN_A, *KNOBS, "--threshold", "1.5", "1,2,3"], capsys, "threshold=1.5")
  assert "generation_config.json" not in err
  assert cli.main(["generate", "--model", str(d), *KNOBS, "--threshold", "0.5", "1,2,3"]) == 0


@pytest.mark.parametrize("content, want", [
    ("{not json", "tokenizer.json: cannot parse"),
    ('{"model": {"type": "NoSuchModel"}}', "cannot load the tokenizer (tokenizer.json, tokenizer_config.json)"),
])
def test_broken_tokenizer_names_the_file(tmp_path, capsys, content, want):
  d = _copy(api.DEFAULT_MODEL_DIR, tmp_path / "m")
  (d / "tokenizer.json").write_text(content)
  _fails(["--model", d, "1+1"], capsys, want)


def test_mask_and_eos_ids_outside_the_vocabulary(tmp_path, capsys):
  _fails(["--model", GOLDEN_A, *KNOBS, "--mask-id", "100000", "1,2,3"], capsys,
         "--mask-id: mask_id=100000 is outside the model's vocabulary [0, 512)")
  _fails(["--model", GOLDEN_A, *KNOBS, "--eos-id", "-1", "1,2,3"], capsys, "--eos-id: eos_id=-1")
  d = _copy(GOLDEN_A, tmp_path / "m")
  (d / "generation_config.json").write_text('{"eos_id": 512}')
  _fails(["--model", d, *KNOBS, "1,2,3"], capsys, f"{d / 'generation_config.json'}: eos_id=512 is outside")


def test_gen_length_that_cannot_fit_is_refused_before_compiling(tmp_path, capsys, monkeypatch):
  d = _copy(GOLDEN_A, tmp_path / "m")
  cfg = json.loads((d / "config.json").read_text())
  cfg["max_position_embeddings"] = 2**21  # positions allow it; memory does not
  (d / "config.json").write_text(json.dumps(cfg))
  from dinfer_jax.engine import loop
  monkeypatch.setattr(loop, "run_jit", lambda: pytest.fail("must not compile"))
  err = _fails(["--model", d, "--gen-length", "1000000", "--block-length", "1000", "1,2,3"], capsys,
               "--gen-length: gen_length=1000000 needs about", "GiB are available on cpu", "at most about gen_length=")
  fits = int(err.rsplit("gen_length=", 1)[1].split()[0])
  assert 0 < fits < 1000000 and fits % 1000 == 0


def test_check_fits_suggestion_is_the_largest_that_fits():
  model = api.load(GOLDEN_A)
  from dinfer_jax.engine.config import GenerationConfig
  g = GenerationConfig(gen_length=64, block_length=8, cache="dual", prompt_bucket=8)
  rows_len = lambda gl: (1, 8 + gl)  # prompt of 3 tokens -> bucket 8; canvas 8 + gen_length
  item = 4
  budget = diagnostics.canvas_bytes(model.config, *rows_len(40), item)
  diagnostics.check_fits(model, [[1, 2, 3]], GenerationConfig(gen_length=40, block_length=8, cache="dual",
                                                             prompt_bucket=8), available=budget)
  with pytest.raises(ValueError, match=r"at most about gen_length=40 fits with 1 prompt"):
    diagnostics.check_fits(model, [[1, 2, 3]], g, available=budget)


def test_nan_weights_are_reported_not_answered(tmp_path, capsys):
  from dinfer_jax.checkpoint.safetensors_io import OutTensor, WeightSet, write_file
  d = _copy(GOLDEN_A, tmp_path / "m")
  ws = WeightSet(d)
  tensors = {k: np.array(ws.read(k)) for k in ws.keys()}
  key = next(k for k in tensors if k.endswith("layers.1.self_attn.q_proj.weight"))
  tensors[key][0, :5] = np.nan
  (d / "model.safetensors.index.json").unlink()
  write_file(d / "model.safetensors", [OutTensor(k, v.dtype, v.shape) for k, v in tensors.items()],
             lambda t: tensors[t.name])
  _fails(["--model", d, *KNOBS, "1,2,3"], capsys, "has NaN/inf weights in", "(5 values)", "checkpoint is broken")


def test_nan_logits_behind_an_empty_answer_are_reported(monkeypatch):
  import jax.numpy as jnp
  model = api.load(GOLDEN_A)
  from dinfer_jax.engine.config import GenerationConfig
  from dinfer_jax.engine.generate import GenerationResult
  g = GenerationConfig(gen_length=16, block_length=8)
  empty = GenerationResult([[]], [[1, 2, 3]], [[]], [0], 1, [1], [3], {})
  diagnostics.check_finite(model, [[1, 2, 3]], g, empty)  # finite logits: an empty answer is an answer
  monkeypatch.setattr(api, "forward", lambda m, ids: jnp.full((1, len(ids[0]), 512), jnp.nan))
  with pytest.raises(ValueError, match="logits are NaN/inf for prompt 0 although its weights are finite"):
    diagnostics.check_finite(model, [[1, 2, 3]], g, empty)
  diagnostics.check_finite(model, [[1, 2, 3]], g, GenerationResult([[7]], [[1, 2, 3, 7]], [[1]], [1], 1, [1],
                                                                    [3], {}))  # not empty: no check


def test_generate_prints_the_answer_and_no_warnings():
  """transformers' advice that PyTorch is missing and its model_type warning do not concern us."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
  r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "generate", "What is 12 + 7?"], env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout == "19\n" and r.stderr == "", r


def test_available_bytes_reads_accelerator_memory_stats():
  class Device:
    platform = "gpu"

    def memory_stats(self):
      return {"bytes_limit": 100 * 2**30, "bytes_in_use": 30 * 2**30}

  assert diagnostics.available_bytes(Device()) == 70 * 2**30
  Device.memory_stats = lambda self: None  # a backend without statistics: no check rather than a wrong one
  assert diagnostics.available_bytes(Device()) is None
  assert diagnostics.available_bytes() > 0  # this CPU machine's MemAvailable


@pytest.mark.parametrize("argv, data, wants", [
    (["--file", "{f}"], b"What is 1+1?\nWhat is 2+\xff2?\n", ["prompts file {f}:2: not UTF-8 text (byte 0xff"]),
    (["--file", "{f}"], b'{"prompt": "What is 1+1?"}\n{"prompt": "  "}\n', ["prompts file {f}:2: empty prompt"]),
    ([""], None, ["prompt 0 is empty"]),
    (["What is 1+1?", " "], None, ["prompt 1 is empty"]),
])
def test_prompt_files_and_empty_prompts(tmp_path, capsys, argv, data, wants):
  f = tmp_path / "prompts.txt"
  if data is not None:
    f.write_bytes(data)
  _fails([a.format(f=f) for a in argv], capsys, *[w.format(f=f) for w in wants])


def test_text_to_a_model_without_a_tokenizer_is_a_usage_error(capsys):
  """It exited 1 through SystemExit while every other usage error exits 2 with one line."""
  _fails(["--model", GOLDEN_A, "hello there"], capsys, "has no tokenizer; give prompts as token ids like '12,7,99'")
