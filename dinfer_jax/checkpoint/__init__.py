"""Checkpoint conversion between HF safetensors and the JAX (orbax) param tree.

  is_hf_checkpoint(path) -> bool
  is_converted_checkpoint(path) -> bool
  read_hf_config(path) -> (ModelConfig, raw config dict)
  load_hf_params(path, cfg=None, dtype='bfloat16', *, shardings=None) -> params
  save_converted(dst, params, hf_config_dict, *, src_dir_for_tokenizer=None, layout='per_expert',
                 overwrite=False, source_dtype=None) -> summary
  load_converted(path, *, dtype=None, shardings=None) -> (params, ModelConfig, raw config dict)
  hf2jax(src, dst, dtype='bfloat16', *, overwrite=False, replace_unmarked=False) -> summary
  jax2hf(src, dst, *, dtype=None, layout=None, overwrite=False, max_shard_bytes=5 GiB,
         replace_unmarked=False) -> summary
  inspect(path) -> [(name, shape, dtype name)]
  expected_hf_keys(cfg, layout) -> {HF key: shape}

The key map is the table in keymap.py; the converted-format layout is documented in converted.py; which
output directories may be written or replaced, and how interrupted writes are cleaned up, in outdir.py;
the command line (`python -m convert`) in cli.py.
Every bad input raises CheckpointError (or ConfigError for the config itself) with a one-line message.
"""
from dinfer_jax.checkpoint.converted import is_converted_checkpoint, load_converted, save_converted
from dinfer_jax.checkpoint.errors import CheckpointError
from dinfer_jax.checkpoint.hf import is_hf_checkpoint, load_hf_params, read_hf_config
from dinfer_jax.checkpoint.keymap import LAYOUTS, expected_hf_keys
from dinfer_jax.checkpoint.ops import describe, hf2jax, inspect, jax2hf

__all__ = [
    "CheckpointError", "LAYOUTS", "describe", "expected_hf_keys", "hf2jax", "inspect", "is_converted_checkpoint",
    "is_hf_checkpoint", "jax2hf", "load_converted", "load_hf_params", "read_hf_config", "save_converted",
]
