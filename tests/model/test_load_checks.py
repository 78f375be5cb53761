"""What `load` refuses before it allocates or answers: weights holding NaN/Inf (named; allow_nonfinite loads
them), config values that are not finite or a head count of 0 (named, not a ZeroDivisionError), tokenizer
files that are not regular files (a FIFO would block for ever, /dev/zero fill the memory)."""
import json
import os
import pathlib
import shutil

import numpy as np
import pytest

import dinfer_jax
from dinfer_jax import api
from dinfer_jax import checkpoint
from dinfer_jax.checkpoint.errors import CheckpointError
from dinfer_jax.config import ConfigError

GOLD = pathlib.Path(__file__).parent.parent / "golden" / "forward" / "tiny_llada_moe"


def _copy(tmp_path) -> pathlib.Path:
  dst = tmp_path / "m"
  shutil.copytree(GOLD, dst, ignore=shutil.ignore_patterns("*.npy"))
  for f in dst.iterdir():
    f.chmod(0o644)
  return dst


def test_nonfinite_weights_are_refused_by_name(tmp_path):
  cfg, hf = checkpoint.read_hf_config(GOLD)
  params = checkpoint.load_hf_params(GOLD, cfg, "float32")
  params["final_norm"] = np.array(params["final_norm"])
  params["final_norm"][3] = np.nan
  checkpoint.save_converted(tmp_path / "conv", params, hf)
  with pytest.raises(CheckpointError, match=r"NaN/inf weights in final_norm \(1 values\).*allow_nonfinite"):
    dinfer_jax.load(tmp_path / "conv")
  m = dinfer_jax.load(tmp_path / "conv", allow_nonfinite=True)
  assert np.isnan(np.asarray(m.params["final_norm"])).sum() == 1


@pytest.mark.parametrize("key,value,why", [
    ("rms_norm_eps", float("inf"), "'rms_norm_eps' must be a finite number"),
    ("rope_theta", float("nan"), "'rope_theta' must be a finite number"),
    ("num_attention_heads", 0, "'num_attention_heads' must be positive")])
def test_config_values_that_cannot_be_are_named(tmp_path, key, value, why):
  d = _copy(tmp_path)
  hf = json.loads((d / "config.json").read_text())
  hf[key] = value
  (d / "config.json").write_text(json.dumps(hf))  # json writes Infinity / NaN, and Python reads them back
  with pytest.raises(ConfigError, match=why):
    api.load_config(d)


def test_tokenizer_files_must_be_regular(tmp_path):
  d = _copy(tmp_path)
  os.mkfifo(d / "tokenizer.json")
  with pytest.raises(CheckpointError, match="tokenizer.json: not a regular file"):
    dinfer_jax.load(d)
  (d / "tokenizer.json").unlink()
  (d / "tokenizer.json").symlink_to("/dev/zero")
  with pytest.raises(CheckpointError, match="tokenizer.json: not a regular file"):
    dinfer_jax.load(d)


@pytest.mark.parametrize("key,value,why", [("num_hidden_layers", 10**9, "1000000000 layers but the weights hold 2"),
                                           ("num_experts", 10**9, "1000000000 experts but the weights hold 8")])
def test_sizes_the_weights_do_not_hold_are_refused_before_anything_is_built(tmp_path, key, value, why):
  """A config claiming far more layers or experts than the weight files hold is refused at once (it took 3 GB
  and over a minute before any error)."""
  d = _copy(tmp_path)
  hf = json.loads((d / "config.json").read_text())
  hf[key] = value
  (d / "config.json").write_text(json.dumps(hf))
  with pytest.raises(CheckpointError, match=why):
    dinfer_jax.load(d)


@pytest.mark.parametrize("key,value,leaf", [("num_hidden_layers", 10**9, "moe_layers.attn_norm"),
                                            ("num_experts", 10**9, "moe_layers.experts.down"),
                                            ("vocab_size", 10**11, "embed")])
def test_converted_checkpoint_sizes_are_checked_against_its_metadata_first(tmp_path, key, value, leaf):
  """The converted (orbax) path compares config.json's shapes with the stored arrays' metadata before any leaf
  is read, so an absurd size is a one-line error, not an allocation."""
  cfg, hf = checkpoint.read_hf_config(GOLD)
  checkpoint.save_converted(tmp_path / "conv", checkpoint.load_hf_params(GOLD, cfg, "float32"), hf)
  f = tmp_path / "conv" / "config.json"
  f.write_text(json.dumps({**json.loads(f.read_text()), key: value}))
  with pytest.raises(CheckpointError, match=rf"stored leaf {leaf} has shape \(.*\), expected \(.*{value}.*\) "
                     "from config.json"):
    dinfer_jax.load(tmp_path / "conv")
