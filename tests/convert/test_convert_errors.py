"""Each bad input: its own one-line error naming key/shape/file, and nothing left at DST."""
import json
import struct

import ml_dtypes
import numpy as np
import pytest

from ckpt_testlib import MODELS, arrays, copy_model, leftovers, load_config, write_hf
from dinfer_jax import checkpoint as ck
from dinfer_jax.config import ConfigError

Q = "model.layers.1.self_attn.q_proj.weight"


def _convert_fails(tmp_path, src, exc, match):
  dst = tmp_path / "out"
  with pytest.raises(exc, match=match) as info:
    ck.hf2jax(src, dst)
  msg = str(info.value)
  assert "\n" not in msg
  assert leftovers(tmp_path, "out") == []
  return msg


def _variant(tmp_path, edit, name="llada_moe", **kw):
  t = arrays(MODELS[name])
  edit(t)
  return write_hf(tmp_path / "src", t, load_config(name), **kw)


def test_missing_tensor(tmp_path):
  src = _variant(tmp_path, lambda t: t.pop(Q))
  _convert_fails(tmp_path, src, ck.CheckpointError, rf"missing tensor '{Q}' \(expected shape \(64, 64\)\)")


def test_many_missing_are_counted(tmp_path):
  src = _variant(tmp_path, lambda t: [t.pop(k) for k in list(t) if "experts.3." in k])
  _convert_fails(tmp_path, src, ck.CheckpointError, r"missing tensor 'model\.layers\.0\.mlp\.experts\.3\.[\w.]+'.*"
                 r"\(6 missing tensors in all\)")


def test_extra_unmapped_tensor(tmp_path):
  src = _variant(tmp_path, lambda t: t.update({"model.layers.0.mlp.bias": np.zeros(4, ml_dtypes.bfloat16)}))
  _convert_fails(tmp_path, src, ck.CheckpointError,
                 r"unmapped tensor 'model\.layers\.0\.mlp\.bias' \(4,\) in model\.safetensors: no llada_moe rule")


def test_extra_layer_out_of_range(tmp_path):
  src = _variant(tmp_path, lambda t: t.update({"model.layers.7.input_layernorm.weight": t["model.norm.weight"]}))
  _convert_fails(tmp_path, src, ck.CheckpointError, r"'model\.layers\.7\.input_layernorm\.weight'.*layer 7 is out of "
                 r"range \(config has 2 layers\)")


def test_mixed_layouts(tmp_path):
  fused = arrays(MODELS["llada_moe_fused"])
  src = _variant(tmp_path, lambda t: t.update({"model.layers.0.mlp.w2": fused["model.layers.0.mlp.w2"]}))
  _convert_fails(tmp_path, src, ck.CheckpointError, r"mixed expert layouts: 'model\.layers\.0\.mlp\.w2' is fused")


def test_ignored_buffers_are_allowed(tmp_path):
  src = _variant(tmp_path, lambda t: t.update(
      {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
  ck.hf2jax(src, tmp_path / "out")


def test_wrong_shape(tmp_path):
  src = _variant(tmp_path, lambda t: t.update({Q: t[Q][:, :32].copy()}))
  _convert_fails(tmp_path, src, ck.CheckpointError,
                 rf"tensor '{Q}' in model\.safetensors has shape \(64, 32\), expected \(64, 64\)")


def test_int_dtype(tmp_path):
  src = _variant(tmp_path, lambda t: t.update({Q: t[Q].astype(np.int32)}))
  _convert_fails(tmp_path, src, ck.CheckpointError, rf"tensor '{Q}' in model\.safetensors has dtype I32 \(int32\)")


def test_duplicated_key_across_shards(tmp_path):
  t = arrays(MODELS["llada_moe"])
  first = [k for k in t if ".layers.1." in k]
  assert Q in first
  src = write_hf(tmp_path / "src", t, load_config("llada_moe"), shards=[first, [k for k in t if k not in first] + [Q]])
  _convert_fails(tmp_path, src, ck.CheckpointError,
                 rf"duplicated tensor '{Q}': in model-00001-of-00002\.safetensors and in model-00002-of-00002")


def test_missing_shard(tmp_path):
  src = _variant(tmp_path, lambda t: None, extra_index={Q: "model-00009-of-00009.safetensors"})
  _convert_fails(tmp_path, src, ck.CheckpointError,
                 r"shard 'model-00009-of-00009\.safetensors' \(holding e\.g\. 'model\.layers\.1\.self_attn\.q_proj"
                 r"\.weight'\) does not exist")


def test_index_lies_about_key(tmp_path):
  t = arrays(MODELS["llada_moe"])
  keys = list(t)
  src = write_hf(tmp_path / "src", t, load_config("llada_moe"), shards=[keys[:40], keys[40:]])
  idx = json.loads((src / "model.safetensors.index.json").read_text())
  idx["weight_map"][keys[0]] = "model-00002-of-00002.safetensors"
  (src / "model.safetensors.index.json").write_text(json.dumps(idx))
  _convert_fails(tmp_path, src, ck.CheckpointError, rf"'{keys[0]}' is listed in shard 'model-00002-of-00002"
                 r"\.safetensors' but is in model-00001-of-00002\.safetensors")


def test_truncated_file(tmp_path):
  src = copy_model("llada_moe", tmp_path / "src")
  f = src / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[:-1000])
  _convert_fails(tmp_path, src, ck.CheckpointError, r"model\.safetensors: truncated: tensor '.+' ends at data byte")


def test_truncated_inside_header(tmp_path):
  src = copy_model("llada_moe", tmp_path / "src")
  f = src / "model.safetensors"
  f.write_bytes(f.read_bytes()[:100])
  _convert_fails(tmp_path, src, ck.CheckpointError, r"model\.safetensors: corrupt or truncated: header length field")


def test_corrupt_header_json(tmp_path):
  src = copy_model("llada_moe", tmp_path / "src")
  f = src / "model.safetensors"
  data = bytearray(f.read_bytes())
  data[8:9] = b"X"  # the opening brace of the JSON header
  f.write_bytes(bytes(data))
  _convert_fails(tmp_path, src, ck.CheckpointError, r"model\.safetensors: corrupt header: not valid JSON")


def test_corrupt_header_offsets(tmp_path):
  src = copy_model("llada_moe", tmp_path / "src")
  f = src / "model.safetensors"
  data = f.read_bytes()
  n = struct.unpack("<Q", data[:8])[0]
  header = json.loads(data[8:8 + n])
  header[Q]["shape"] = [64, 65]  # offsets no longer match shape x itemsize
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (n - len(raw))
  assert len(raw) == n
  f.write_bytes(data[:8] + raw + data[8 + n:])
  _convert_fails(tmp_path, src, ck.CheckpointError, rf"corrupt header: tensor '{Q}' \(BF16 \(64, 65\)\) needs 8320 "
                 r"bytes but data_offsets span 8192")


def test_corrupt_header_length(tmp_path):
  src = copy_model("llada_moe", tmp_path / "src")
  f = src / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(struct.pack("<Q", 2**40) + data[8:])
  _convert_fails(tmp_path, src, ck.CheckpointError, r"model\.safetensors: corrupt or truncated: header length field "
                 r"says 1099511627776 bytes")


def test_unknown_model_type(tmp_path):
  src = copy_model("llada_moe", tmp_path / "src")
  cfg = load_config("llada_moe")
  cfg["model_type"] = "mixtral"
  (src / "config.json").write_text(json.dumps(cfg))
  _convert_fails(tmp_path, src, ConfigError, r"src/config\.json: unknown model_type 'mixtral'")


def test_missing_config(tmp_path):
  src = copy_model("llada_moe", tmp_path / "src")
  (src / "config.json").unlink()
  _convert_fails(tmp_path, src, ck.CheckpointError, r"src: config\.json not found")


def test_bad_config_json(tmp_path):
  src = copy_model("llada_moe", tmp_path / "src")
  (src / "config.json").write_text("{not json")
  _convert_fails(tmp_path, src, ck.CheckpointError, r"config\.json: cannot parse")


def test_no_weights(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  (src / "config.json").write_text(json.dumps(load_config("llada_moe")))
  _convert_fails(tmp_path, src, ck.CheckpointError, r"src: no model\.safetensors or model\.safetensors\.index\.json")


def test_config_weights_mismatch(tmp_path):
  """A config that says 3 layers for a 2-layer checkpoint: the first missing key of layer 2 is named."""
  src = copy_model("llada_moe", tmp_path / "src")
  cfg = load_config("llada_moe")
  cfg["num_hidden_layers"] = 3
  (src / "config.json").write_text(json.dumps(cfg))
  _convert_fails(tmp_path, src, ck.CheckpointError, r"missing tensor 'model\.layers\.2\.")


def test_refuses_existing_dst_unless_overwrite(tmp_path):
  dst = tmp_path / "out"
  ck.hf2jax(MODELS["llada"], dst)
  with pytest.raises(ck.CheckpointError, match="already exists"):
    ck.hf2jax(MODELS["llada"], dst)
  (dst / "keep").write_text("x")
  ck.hf2jax(MODELS["llada"], dst, overwrite=True)  # an earlier output of ours: replaced
  assert not (dst / "keep").exists() and ck.is_converted_checkpoint(dst)
  assert leftovers(tmp_path, "out") == ["out"]


def test_overwrite_refuses_a_directory_it_did_not_write(tmp_path):
  dst = tmp_path / "out"
  dst.mkdir()
  (dst / "keep").write_text("x")
  with pytest.raises(ck.CheckpointError, match=r"not written by dinfer-jax .*--overwrite-unmarked"):
    ck.hf2jax(MODELS["llada"], dst, overwrite=True)
  assert (dst / "keep").read_text() == "x" and leftovers(tmp_path, "out") == ["out"]
  ck.hf2jax(MODELS["llada"], dst, overwrite=True, replace_unmarked=True)  # named explicitly
  assert not (dst / "keep").exists() and ck.is_converted_checkpoint(dst)


def test_failed_overwrite_keeps_old_dst(tmp_path):
  dst = tmp_path / "out"
  ck.hf2jax(MODELS["llada"], dst)
  src = _variant(tmp_path, lambda t: t.pop(Q))
  with pytest.raises(ck.CheckpointError, match="missing tensor"):
    ck.hf2jax(src, dst, overwrite=True)
  assert ck.is_converted_checkpoint(dst) and leftovers(tmp_path, "out") == ["out"]


def test_failure_during_write_cleans_up(tmp_path, monkeypatch):
  """An error after writing started (here: a read failing mid-save) leaves no DST and no temp dir."""
  from dinfer_jax.checkpoint import hf

  def boom(self, key):
    raise OSError("disk on fire")

  monkeypatch.setattr(hf.WeightSet, "read", boom)
  with pytest.raises(ck.CheckpointError, match="writing params failed: OSError: disk on fire"):
    ck.hf2jax(MODELS["llada"], tmp_path / "out")
  assert leftovers(tmp_path, "out") == []


def test_jax2hf_errors(tmp_path):
  with pytest.raises(ck.CheckpointError, match="not a converted checkpoint"):
    ck.jax2hf(MODELS["llada"], tmp_path / "out")
  ck.hf2jax(MODELS["llada"], tmp_path / "j")
  with pytest.raises(ck.CheckpointError, match="unknown layout 'packed'"):
    ck.jax2hf(tmp_path / "j", tmp_path / "out", layout="packed")
  with pytest.raises(ck.CheckpointError, match="unsupported dtype 'int8'"):
    ck.jax2hf(tmp_path / "j", tmp_path / "out", dtype="int8")
  assert leftovers(tmp_path, "out") == []
  # a converted checkpoint whose config no longer matches its params
  cfg = load_config("llada")
  cfg["mlp_hidden_size"] = 256
  (tmp_path / "j" / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ck.CheckpointError, match=r"stored leaf dense_layers\.mlp\.down has shape \(2, 128, 64\), "
                     r"expected \(2, 256, 64\)"):
    ck.load_converted(tmp_path / "j")


def test_save_converted_checks_tree(tmp_path):
  params = ck.load_hf_params(MODELS["llada"])
  raw = load_config("llada")
  params["dense_layers"]["q"] = params["dense_layers"]["q"][:, :, :2]
  with pytest.raises(ck.CheckpointError, match=r"leaf dense_layers\.q has shape \(2, 64, 2, 16\), expected "
                     r"\(2, 64, 4, 16\)"):
    ck.save_converted(tmp_path / "out", params, raw)
  assert leftovers(tmp_path, "out") == []


def test_torch_bin_only(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  (src / "config.json").write_text(json.dumps(load_config("llada")))
  (src / "pytorch_model.bin").write_bytes(b"\0" * 16)
  _convert_fails(tmp_path, src, ck.CheckpointError, r"no model\.safetensors or model\.safetensors\.index\.json "
                 r"\(found pytorch_model\.bin; only safetensors")
